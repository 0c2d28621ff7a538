"""The verify budget policy: calibration, exploration, pauses, pricing of whole steps."""

import pytest

from specserve.speculative.step_cost import StepCostCurve
from tests.speculative.conftest import observe


def test_budget_policy_explores_so_a_pessimistic_start_is_corrected():
    from specserve.speculative.budget_policy import EXPLORE_EVERY, VerifyBudgetPolicy

    class Sched:
        running, waiting, max_num_seqs = [], [], 4

    class Eng:
        scheduler = Sched()

    curve = StepCostCurve([1, 2, 4, 8])
    curve.calibrate(lambda rows: 1.0 if rows == 1 else 10.0, reps=1)  # busy-machine curve
    policy = VerifyBudgetPolicy.from_curves(Eng(), 64, curve)
    kept = [policy.trim([object()], [[5, 6, 7]], [[0.9, 0.9, 0.9]]) for _ in range(EXPLORE_EVERY)]
    assert kept[:-1] == [[0]] * (EXPLORE_EVERY - 1) and kept[-1] == [3]
    for _ in range(3):  # the explored steps show verifying is cheap: the curve is corrected
        policy.curve.record(4, 1.05)
    # (unobserved bucket 1 is now priced optimistically, scaled like bucket 4: a plain step runs
    # once and shows its real cost)
    observe(policy.curve, 1, 1.0)
    assert policy.trim([object()], [[5, 6, 7]], [[0.9, 0.9, 0.9]]) == [3]


def test_every_step_explores_while_learned_confidences_are_young():
    """A drafter whose confidences are learned (n-gram) and rest on few verifications gets its
    drafts verified every step, not one step in EXPLORE_EVERY: a low first estimate would
    otherwise keep itself (nothing verified, nothing learned). Given confidences (None) and
    learned ones with enough samples explore at the usual rate."""
    from types import SimpleNamespace

    from specserve.speculative.budget_policy import (
        EXPLORE_EVERY,
        EXPLORE_UNTIL_SAMPLES,
        VerifyBudgetPolicy,
    )

    curve = StepCostCurve([1, 2, 4, 8])
    curve.calibrate(lambda rows: 1.0 if rows == 1 else 10.0, reps=1)  # drafts never pay
    drafter = SimpleNamespace(samples=0)
    drafter.confidence_samples = lambda: drafter.samples
    sched = SimpleNamespace(running=[], waiting=[], max_num_seqs=4)
    eng = SimpleNamespace(scheduler=sched, drafter=drafter)
    policy = VerifyBudgetPolicy.from_curves(eng, 64, curve)

    def trims(n: int) -> list[list[int]]:
        return [policy.trim([object()], [[5, 6, 7]], [[0.1, 0.1, 0.1]]) for _ in range(n)]

    assert trims(EXPLORE_EVERY) == [[3]] * EXPLORE_EVERY  # young: every step
    assert policy.seqlens_q() == {4: EXPLORE_EVERY}  # the metric: 1 + 3 drafts, per request
    drafter.samples = EXPLORE_UNTIL_SAMPLES
    kept = trims(EXPLORE_EVERY)
    assert kept.count([3]) == 1 and kept.count([0]) == EXPLORE_EVERY - 1
    drafter.samples = None  # confidences given: the usual rate
    kept = trims(EXPLORE_EVERY)
    assert kept.count([3]) == 1 and kept.count([0]) == EXPLORE_EVERY - 1


def test_overlapped_plain_decoding_is_priced_with_its_own_curve():
    """With a host drafter, no drafts at all means the step can run overlapped (host work hidden):
    when that plain step is cheap enough, it beats the speculative choice priced on the
    synchronous curve; when it is not, the drafts stay."""
    from specserve.speculative.budget_policy import VerifyBudgetPolicy

    class Sched:
        running, waiting, max_num_seqs = [], [], 64

    class Eng:
        scheduler = Sched()

    def policy_with(plain_cost: float) -> VerifyBudgetPolicy:
        curve = StepCostCurve([8, 16, 32, 64, 128])
        curve.calibrate(lambda rows: 1.0 + rows / 64, reps=1)  # synchronous steps
        plain = StepCostCurve(curve.buckets)
        plain.calibrate(lambda rows: plain_cost * (1.0 + rows / 64), reps=1)
        return VerifyBudgetPolicy.from_curves(Eng(), 512, curve, plain)

    ready = [object()] * 32
    drafts, confs = [[1, 2]] * 32, [[0.6, 0.5]] * 32
    # synchronous: 32 rows cost 1.5, 96 rows 2.5; E = 32 * 1.9 = 60.8 -> 24.3 tok/s vs 21.3 plain
    assert sum(policy_with(1.0).trim(ready, drafts, confs)) > 0
    fast_plain = policy_with(0.7)  # overlap hides 30 % of the step: 30.5 tok/s plain
    assert fast_plain.trim(ready, drafts, confs) == [0] * 32
    assert fast_plain.plain_chosen == 1
    # the host work a synchronous step adds (scheduling, ledger, drafting: hidden under overlap)
    # is part of a speculative step's price: a slow drafter tips the same case to plain
    slow_drafter = policy_with(1.0)
    slow_drafter.record_sync_overhead(1.0, 32)
    assert slow_drafter.trim(ready, drafts, confs) == [0] * 32


def test_speculation_against_plain_is_weighed_at_the_level_of_real_periods():
    """The curves are medians; throughput follows mean periods, and synchronous steps expose
    host hiccups that overlapped plain steps hide. When real synchronous periods run 25 % above
    their prediction, a speculative step priced 20 % better than plain decoding loses to it;
    when plain steps' mean runs as far above their median, speculation wins again."""
    from types import SimpleNamespace

    from specserve.speculative.budget_policy import VerifyBudgetPolicy
    from specserve.speculative.period_bias import MIN_SAMPLES

    sched = SimpleNamespace(running=[], waiting=[], max_num_seqs=64)
    curve = StepCostCurve([8, 16, 32, 64, 128])
    curve.calibrate(lambda rows: 1.0 + rows / 64, reps=1)
    plain = StepCostCurve(curve.buckets)
    plain.calibrate(lambda rows: 1.0 + rows / 64, reps=1)
    p = VerifyBudgetPolicy.from_curves(SimpleNamespace(scheduler=sched), 512, curve, plain)
    ready, drafts, confs = [object()] * 32, [[1, 2]] * 32, [[0.6, 0.5]] * 32
    # best: the 32 first drafts, 64 rows: 32 * 1.6 = 51.2 tokens in 2.0 -> 25.6 tok/s, against
    # 32 / 1.5 = 21.3 plain
    assert p.trim(ready, drafts, confs) == [1] * 32
    p.record_sync_period(64, 10.0, 0, 32)  # priced from start-up values: not a bias sample
    observe(curve, 64, 2.0)  # real steps: the curve's median at 64 rows is 2.0
    for _ in range(MIN_SAMPLES):
        p.record_sync_period(64, 1.25 * 2.0, 0, 32)  # 25 % above it
    assert p.sync_bias.factor == pytest.approx(1.25)
    assert p.trim(ready, drafts, confs) == [0] * 32  # 25.6 / 1.25 = 20.5 < 21.3
    # plain steps with a tail: their median (the curve) stays 1.5, their mean runs above it
    for t in [1.5, 1.5, 1.5, 4.5] * 3:
        p.record_plain_step(32, t, 0, 32)
    assert p.plain.at(32, 0, 32) == pytest.approx(1.5)
    assert p.plain_bias.factor >= 1.25
    assert p.trim(ready, drafts, confs) == [1] * 32


def test_plain_decoding_at_an_unmeasured_load_gets_one_pause_to_measure_it():
    """Plain decoding's price at a load where it never ran is the start-up one (synthetic
    steps, a sync each: dearer than overlapped steps). Speculation priced against it can win
    every step, and then no plain step runs to correct it: halfway between draft explorations
    the budget pauses once (all drafts dropped) while that load's plain bucket is unmeasured and
    speculation's lead is small enough for that price's error to matter."""
    from types import SimpleNamespace

    from specserve.speculative.budget_policy import EXPLORE_EVERY, VerifyBudgetPolicy

    sched = SimpleNamespace(running=[], waiting=[], max_num_seqs=64)
    curve = StepCostCurve([8, 16, 32, 64, 128])
    curve.calibrate(lambda rows: 1.0 + rows / 64, reps=1)
    plain = StepCostCurve(curve.buckets)
    plain.calibrate(lambda rows: 1.0 + rows / 64, reps=1)  # start-up values only
    p = VerifyBudgetPolicy.from_curves(SimpleNamespace(scheduler=sched), 512, curve, plain)
    ready, drafts, confs = [object()] * 32, [[1, 2]] * 32, [[0.6, 0.5]] * 32
    kept = [p.trim(ready, drafts, confs) for _ in range(EXPLORE_EVERY)]
    paused = [i for i, k in enumerate(kept) if not any(k)]
    assert paused == [EXPLORE_EVERY // 2 - 1] and p.plain_explored == 1
    assert sum(kept[-1]) > 32  # the draft exploration still comes at its turn
    observe(plain, 32, 1.5)  # the pause's overlapped steps measured plain decoding at 32 rows
    kept = [p.trim(ready, drafts, confs) for _ in range(EXPLORE_EVERY)]
    assert all(any(k) for k in kept) and p.plain_explored == 1
    # where speculation wins by more than PLAIN_DOUBT, the start-up price cannot flip it: no
    # pause (32 x 2.98 tokens in 2.5 -> 38 tok/s, 1.8x the 21.3 of plain)
    sure = VerifyBudgetPolicy.from_curves(SimpleNamespace(scheduler=sched), 512, curve, plain)
    sure.plain = StepCostCurve(curve.buckets)
    sure.plain.calibrate(lambda rows: 1.0 + rows / 64, reps=1)
    kept = [sure.trim(ready, drafts, [[0.99, 0.99]] * 32) for _ in range(EXPLORE_EVERY)]
    assert all(any(k) for k in kept) and sure.plain_explored == 0


def _slow_spell_policy():
    """A policy at 32 requests x 2 drafts whose synchronous price comes from a slow spell:
    32 x 1.6 tokens in 2.7 -> 19.0 tok/s, below plain's 21.3 but near enough to probe. Returns
    the policy, its synchronous curve and trim(step): the trim drafting for step `step`."""
    from types import SimpleNamespace

    from specserve.speculative.budget_policy import VerifyBudgetPolicy

    sched = SimpleNamespace(running=[], waiting=[], max_num_seqs=64, step_id=0)
    curve = StepCostCurve([8, 16, 32, 64, 128], padded=True)
    curve.calibrate(lambda rows: 1.0 + rows / 64, reps=1)
    plain = StepCostCurve(curve.buckets, padded=True)
    plain.calibrate(lambda rows: 1.0 + rows / 64, reps=1)
    observe(plain, 32, 1.5)
    p = VerifyBudgetPolicy.from_curves(SimpleNamespace(scheduler=sched), 512, curve, plain)
    ready, drafts, confs = [object()] * 32, [[1, 2]] * 32, [[0.6, 0.5]] * 32
    for _ in range(32):
        curve.record(64, 2.7)

    def trim(step: int) -> list[int]:
        sched.step_id = step - 1  # the trim drafts for the step after the scheduler's last
        return p.trim(ready, drafts, confs)

    return p, curve, trim


def test_speculation_that_lost_to_plain_is_re_measured_when_its_price_is_old():
    """The mirror of the plain pause: while plain decoding wins, no synchronous step runs, so a
    speculative price set in a slow spell would never be corrected. Once speculation's newest
    step is PROBE_AFTER steps old and plain wins by less than PLAIN_DOUBT, PROBE_STEPS trims keep
    the speculative choice; their steps replace the old synchronous measurements, and with the
    corrected price speculation wins again. Where plain wins by more, no probe."""

    from specserve.speculative.probes import PROBE_AFTER, PROBE_STEPS

    p, curve, trim = _slow_spell_policy()

    assert trim(10) == [0] * 32 and p.plain_chosen == 1
    assert trim(PROBE_AFTER - 1) == [0] * 32  # speculation's newest step is not old enough
    probe = [trim(PROBE_AFTER + i) for i in range(PROBE_STEPS)]
    assert probe == [[1] * 32] * PROBE_STEPS and p.spec_probes == 1
    for _ in range(PROBE_STEPS):
        p.record_step(64, 2.0, 0, 32)  # the probe's steps: the spell is over
    assert p.curve(64) == pytest.approx(2.0)  # the fresh steps replaced the 32 old ones
    assert trim(PROBE_AFTER + PROBE_STEPS) == [1] * 32  # 25.6 tok/s: speculation wins again
    # plain ahead by more than PLAIN_DOUBT: a probe could not flip it; none runs
    for _ in range(32):
        curve.record(64, 5.0)  # 10.2 tok/s
    step = PROBE_AFTER + PROBE_STEPS
    kept = [trim(step + i) for i in range(2 * PROBE_AFTER)]
    assert [1] * 32 not in kept and p.spec_probes == 1  # (draft exploration still runs)


def test_probes_that_confirm_plain_come_ever_more_rarely_until_speculation_wins(monkeypatch):
    """Each probe that confirms plain decoding doubles the wait before the next one at its load
    (H200 sweeps at R = 0.5, C = 64: runs with probes ran 2-7 % below plain, runs without them
    0.6 %), up to PROBE_AFTER_MAX; once speculation wins on its own the wait starts over."""

    from specserve.speculative import budget_policy
    from specserve.speculative.probes import PROBE_AFTER, PROBE_AFTER_MAX, PROBE_STEPS

    monkeypatch.setattr(budget_policy, "EXPLORE_EVERY", 10**9)  # probes alone: no exploration
    p, curve, trim = _slow_spell_policy()

    def probe_starts(first: int, last: int) -> list[int]:
        starts, step = [], first
        while step <= last:
            before = p.spec_probes
            kept = trim(step)
            if p.spec_probes > before:
                starts.append(step)
                for i in range(1, PROBE_STEPS):
                    assert trim(step + i) == kept  # the probe's steps keep the choice
                for _ in range(PROBE_STEPS):
                    p.record_step(64, 2.7, 0, 32)  # the price is confirmed: plain still wins
                step += PROBE_STEPS
            else:
                step += 1
        return starts

    starts = probe_starts(1, 16 * PROBE_AFTER)
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert starts[0] == PROBE_AFTER
    assert gaps[:3] == [2 * PROBE_AFTER + 3, 4 * PROBE_AFTER + 3, 8 * PROBE_AFTER + 3]
    assert all(g == PROBE_AFTER_MAX + PROBE_STEPS - 1 for g in gaps[3:])
    # the spell ends: speculation wins at this load, and the waits start over
    for _ in range(32):
        curve.record(64, 2.0)
    last = starts[-1] + PROBE_AFTER_MAX
    assert any(trim(last + 1))
    for _ in range(32):
        curve.record(64, 2.7)
    again = probe_starts(last + 2, last + 2 + 2 * PROBE_AFTER)
    assert again and again[0] - (last + 1) <= PROBE_AFTER + 1


def test_no_drafts_while_prompts_being_admitted_raise_the_load_to_where_plain_wins():
    """64 requests decode while 192 wait with room to be admitted: within a few steps 256
    decode, where plain decoding wins, so the first 64 keep no drafts now (each would make a
    prompt-filled step synchronous and push prompt rows back). Waiting requests that memory keeps
    out leave the load where it is, and speculation goes on."""
    from types import SimpleNamespace

    from specserve.speculative.budget_policy import VerifyBudgetPolicy

    bm = SimpleNamespace(num_free_blocks=10_000, blocks_needed=lambda tokens: -(-tokens // 16))
    sched = SimpleNamespace(running=[], waiting=[], max_num_seqs=256, bm=bm)
    curve = StepCostCurve([16, 32, 64, 128, 256, 512, 1024], padded=True)
    curve.calibrate(lambda rows: 1.0 + (rows / 128) ** 2, reps=1)  # rows grow dear past 128
    plain = StepCostCurve(curve.buckets, padded=True)
    plain.calibrate(lambda rows: 1.0 + (rows / 128) ** 2, reps=1)
    p = VerifyBudgetPolicy.from_curves(SimpleNamespace(scheduler=sched), 2048, curve, plain)
    decoding = SimpleNamespace(num_uncomputed_tokens=1, token_ids=[0] * 10)
    prefilling = SimpleNamespace(num_uncomputed_tokens=128, token_ids=[0] * 128)

    def kept(n: int) -> int:
        return sum(p.trim([decoding] * n, [[1, 2]] * n, [[0.8, 0.6]] * n))

    sched.running = [decoding] * 64
    assert kept(64) == 64  # 64 decoding: the first drafts pay
    sched.running = [decoding] * 256
    assert kept(256) == 0 and p.plain_ahead == 0  # 256 decoding: plain wins on its own
    waiting = SimpleNamespace(num_tokens=128)  # 9 blocks each
    sched.running, sched.waiting = [decoding] * 64, [waiting] * 192
    assert kept(64) == 0 and p.plain_ahead == 1
    assert p.keeps_pausing()  # the pause it starts lasts while the load is coming
    sched.running = [decoding] * 64 + [prefilling] * 64  # admitted, still prefilling: the same
    sched.waiting = [waiting] * 128
    assert kept(64) == 0 and p.plain_ahead == 2
    bm.num_free_blocks = 8  # memory admits none: the 64 prefilling still join (128: plain)
    assert kept(64) == 0 and p.plain_ahead == 3
    sched.running = [decoding] * 64  # ... and with none prefilling the load stays at 64
    assert kept(64) == 64 and p.plain_ahead == 3
    assert not p.keeps_pausing()


def test_the_end_of_a_pause_is_decided_with_the_last_rounds_confidences():
    """keeps_pausing prices the requests decoding now with the confidences of the last round
    that drafted: still plain under the same load, speculate again once the load falls; no round
    with drafts at all means "draft for real"."""
    from types import SimpleNamespace

    from specserve.speculative.budget_policy import VerifyBudgetPolicy

    sched = SimpleNamespace(running=[], waiting=[], max_num_seqs=64)
    curve = StepCostCurve([1, 8, 16, 32, 64, 128])
    curve.calibrate(lambda rows: 1.0 + rows / 16, reps=1)  # each row costs 1/16 of a step
    plain = StepCostCurve(curve.buckets)
    plain.calibrate(lambda rows: 1.0 + rows / 16, reps=1)
    p = VerifyBudgetPolicy.from_curves(SimpleNamespace(scheduler=sched), 512, curve, plain)
    decoding = SimpleNamespace(num_uncomputed_tokens=1)
    sched.running = [decoding] * 64
    assert not p.keeps_pausing()  # no round has drafted yet: only drafting can tell
    assert p.trim(sched.running, [[1, 2]] * 64, [[0.4, 0.2]] * 64) == [0] * 64
    assert p.keeps_pausing()  # same load, same confidences: stay plain
    sched.running = [decoding] * 2  # the load fell: speculation pays again
    assert not p.keeps_pausing()
    sched.running = [SimpleNamespace(num_uncomputed_tokens=40)] * 2  # only prefills: ask for real
    assert not p.keeps_pausing()


def test_exploration_at_high_load_adds_a_quarter_of_the_step():
    """Every EXPLORE_EVERY-th trim verifies all drafts of some requests past the choice, up to a
    quarter of the step's rows (not every draft: at 256 requests x 4 that would be a 5x step);
    the requests take turns, so every draft position of every request gets verified now and
    then (acceptance estimates learn only from verified drafts)."""
    from types import SimpleNamespace

    from specserve.speculative.budget_policy import EXPLORE_EVERY, VerifyBudgetPolicy

    sched = SimpleNamespace(running=[], waiting=[], max_num_seqs=256)
    curve = StepCostCurve([1, 64, 256, 512, 1280])
    curve.calibrate(lambda rows: 1.0 + rows / 16, reps=1)  # rows are expensive: no drafts
    p = VerifyBudgetPolicy.from_curves(SimpleNamespace(scheduler=sched), 8192, curve)
    ready = [object()] * 256
    confs = [[0.5 + 0.1 * (i % 4)] * 4 for i in range(256)]
    drafts = [[1, 2, 3, 4]] * 256
    explored = []
    for _ in range(256 // 16):
        kept = [p.trim(ready, drafts, confs) for _ in range(EXPLORE_EVERY)]
        assert all(sum(k) == 0 for k in kept[:-1])
        assert sum(kept[-1]) == 256 // 4 and set(kept[-1]) == {0, 4}  # whole requests
        explored.append({i for i, m in enumerate(kept[-1]) if m})
    assert set().union(*explored) == set(range(256))  # everyone's turn came


def test_the_chooser_prices_whole_step_periods():
    """The host work around a synchronous step (ledger, drafting, scheduling) is a fixed cost per
    step: next to it, extra verify rows are cheaper than the device curve alone says. Without
    it a 50 % draft per request is not worth its rows here; with it, it is."""
    from types import SimpleNamespace

    from specserve.speculative.budget_policy import VerifyBudgetPolicy

    sched = SimpleNamespace(running=[], waiting=[], max_num_seqs=64)
    curve = StepCostCurve([16, 32, 64])
    curve.calibrate(lambda rows: rows / 16, reps=1)  # device time: 1.0 at 16 rows, 2.0 at 32
    ready, drafts, confs = [object()] * 16, [[1]] * 16, [[0.5]] * 16
    p = VerifyBudgetPolicy.from_curves(SimpleNamespace(scheduler=sched), 512, curve)
    assert p.trim(ready, drafts, confs) == [0] * 16  # 16 / 1.0 beats 24 / 2.0
    p.record_sync_overhead(2.0, 16)
    assert p.trim(ready, drafts, confs) == [1] * 16  # 24 / 4.0 beats 16 / 3.0


def test_long_contexts_make_verify_rows_relatively_cheap():
    """Context reads are a fixed cost of the step (the requests do not change with the rows
    chosen): next to a large one, drafts that did not pay with short contexts pay."""
    from types import SimpleNamespace

    from specserve.speculative.budget_policy import VerifyBudgetPolicy

    sched = SimpleNamespace(running=[], waiting=[], max_num_seqs=64)
    curve = StepCostCurve([16, 32, 64], kv_cost=1e-4)
    curve.calibrate(lambda rows: rows / 16, reps=1)  # f: 1.0 at 16 rows, 2.0 at 32
    p = VerifyBudgetPolicy.from_curves(SimpleNamespace(scheduler=sched), 512, curve)
    drafts, confs = [[1]] * 16, [[0.5]] * 16
    short = [SimpleNamespace(token_ids=[0] * 100)] * 16  # 1,600 tokens: +0.16 s
    assert p.trim(short, drafts, confs) == [0] * 16  # 16 / 1.16 beats 24 / 2.16
    long = [SimpleNamespace(token_ids=[0] * 2000)] * 16  # 32,000 tokens: +3.2 s
    assert p.trim(long, drafts, confs) == [1] * 16  # 24 / 5.2 beats 16 / 4.2


def test_per_request_cost_is_fixed_within_a_decision():
    """f(rows) holds no per-request work: a decision over 16 requests adds req_cost * 16 to
    every candidate, so a draft that does not pay against f alone pays next to it."""
    from types import SimpleNamespace

    from specserve.speculative.budget_policy import VerifyBudgetPolicy

    sched = SimpleNamespace(running=[], waiting=[], max_num_seqs=64)
    drafts, confs = [[1]] * 16, [[0.5]] * 16
    ready = [SimpleNamespace(token_ids=[0] * 100)] * 16
    for req_cost, kept in ((0.0, [0] * 16), (0.25, [1] * 16)):
        curve = StepCostCurve([16, 32, 64], req_cost=req_cost)
        curve.calibrate(lambda rows: rows / 16, reps=1)  # f: 1.0 at 16 rows, 2.0 at 32
        p = VerifyBudgetPolicy.from_curves(SimpleNamespace(scheduler=sched), 512, curve)
        # without: 16 / 1.0 beats 24 / 2.0; with +4.0: 24 / 6.0 beats 16 / 5.0
        assert p.trim(ready, drafts, confs) == kept


def test_drafts_are_priced_as_in_a_decode_step_whatever_prompt_work_shares_it():
    """Prompt chunks in the step do not change what a draft row costs the run (it displaces a
    prompt row to a later step, or the prompt rows are work done anyway): drafts that pay in a
    decode-only step are verified even when prompts fill the token budget, and drafts that do
    not pay there are not verified just because a long prompt chunk makes the step long."""
    from types import SimpleNamespace

    from specserve.speculative.budget_policy import VerifyBudgetPolicy

    curve = StepCostCurve([16, 32, 64, 256, 512])
    curve.calibrate(lambda rows: 1.0 + rows / 16, reps=1)  # 16 rows: 2.0, 32 rows: 3.0
    decoding = SimpleNamespace(num_uncomputed_tokens=1, token_ids=[0] * 100)
    ready, drafts = [decoding] * 16, [[1]] * 16
    for prompt_rows in (0, 200, 5000):  # none, a chunk beside, more than the budget holds
        prompt = SimpleNamespace(num_uncomputed_tokens=prompt_rows, token_ids=[0] * prompt_rows)
        sched = SimpleNamespace(running=ready + [prompt], waiting=[], max_num_seqs=64)
        p = VerifyBudgetPolicy.from_curves(SimpleNamespace(scheduler=sched), 512, curve)
        # 16 + 16 * 0.9 = 30.4 tokens in 3.0 beats 16 in 2.0; 16 + 16 * 0.3 = 20.8 does not
        assert p.trim(ready, drafts, [[0.9]] * 16) == [1] * 16, prompt_rows
        assert p.trim(ready, drafts, [[0.3]] * 16) == [0] * 16, prompt_rows


def test_prepare_does_the_next_trims_curve_work_ahead():
    """prepare() runs while the device is busy: it rebuilds the envelope records made stale
    and prices the range the chooser asked for last, so the next trim finds both cached. The
    choice is the same as without it."""
    from types import SimpleNamespace

    from specserve.speculative.budget_policy import VerifyBudgetPolicy

    def policy() -> VerifyBudgetPolicy:
        curve = StepCostCurve([1, 2, 4, 8, 16], padded=True, refresh_every=4)
        curve.calibrate(lambda rows: 1.0 + rows / 8, reps=1)
        sched = SimpleNamespace(running=[], waiting=[], max_num_seqs=8)
        return VerifyBudgetPolicy.from_curves(SimpleNamespace(scheduler=sched), 64, curve)

    ready = [SimpleNamespace(token_ids=[0] * 50)] * 2
    drafts, confs = [[1, 2, 3]] * 2, [[0.9, 0.8, 0.5]] * 2
    ahead, plain = policy(), policy()
    for step in range(12):
        choice = ahead.trim(ready, drafts, confs)
        assert choice == plain.trim(ready, drafts, confs), step
        for p in (ahead, plain):
            p.record_step(2 + sum(choice), 1.2 + 0.01 * step, 100, 2)
        ahead.prepare()
        curve = ahead.curve
        assert curve._envelope is not None  # rebuilt now, not in the next trim
        assert (2, 8) in curve._stops_cache and curve._stops_env is curve._envelope
