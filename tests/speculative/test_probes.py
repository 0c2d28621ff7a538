"""The probe schedule: when speculation that lost to plain decoding is measured again."""

from specserve.speculative.host_overhead import load_range
from specserve.speculative.probes import PROBE_AFTER, PROBE_AFTER_MAX, PROBE_STEPS, ProbeSchedule


def test_a_probe_waits_for_old_prices_and_a_near_verdict_and_lasts_its_steps():
    s = ProbeSchedule()
    assert s.take(PROBE_AFTER - 1, 64, near=True) == (False, False)  # too recent
    assert s.take(PROBE_AFTER, 64, near=False) == (False, False)  # plain wins by too much
    assert s.take(PROBE_AFTER, 64, near=True) == (True, True)  # a new probe: renew prices
    rest = [s.take(PROBE_AFTER + i, 64, near=True) for i in range(1, PROBE_STEPS)]
    assert rest == [(True, False)] * (PROBE_STEPS - 1) and s.count == 1
    assert s.take(PROBE_AFTER + PROBE_STEPS, 64, near=True) == (False, False)


def test_waits_double_per_load_range_and_reset_where_speculation_wins():
    s = ProbeSchedule()
    assert s.take(PROBE_AFTER, 64, near=True)[1]
    s.left = 0
    assert not s.take(2 * PROBE_AFTER - 1, 64, near=True)[0]  # 64's wait doubled
    assert s.take(PROBE_AFTER, 16, near=True)[1]  # another load range keeps its own wait
    s.left = 0
    s.not_overruled(64, speculates=True)  # speculation won at 64 on its own
    assert s.take(PROBE_AFTER, 64, near=True)[1]
    s.left = 0
    for _ in range(10):  # the wait is capped
        s.take(10**9, 64, near=True)
        s.left = 0
    assert s._after[load_range(64)] == PROBE_AFTER_MAX


def test_the_choosers_own_verdict_spends_a_probe_step():
    s = ProbeSchedule()
    s.take(PROBE_AFTER, 64, near=True)
    s.not_overruled(64, speculates=False)
    assert s.left == PROBE_STEPS - 2
