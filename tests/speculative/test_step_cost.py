"""The step-cost curve: medians, envelope, fixed terms, start-up vs real steps, cache."""

import math
import random

import pytest

from specserve.speculative.step_cost import MIN_REAL, StepCostCurve
from tests.speculative.conftest import observe


def test_step_cost_curve_medians_envelope_and_cache(tmp_path):
    curve = StepCostCurve([1, 2, 4, 8])
    curve.calibrate(lambda rows: 0.01 * rows + 0.02, reps=3)
    assert math.isclose(curve(4), 0.06)
    assert math.isclose(curve(3), (curve(2) + curve(4)) / 2)
    for _ in range(40):  # online refinement: recent medians win over the calibration
        curve.record(8, 0.5)
    assert math.isclose(curve(8), 0.5)
    for _ in range(5):
        curve.record(2, 0.03)  # real steps replace the start-up samples of their bucket
    assert math.isclose(curve(2), 0.03)
    curve.record(2, 10.0)  # one outlier moves no median
    assert math.isclose(curve(2), 0.03)
    for _ in range(40):  # a step past the largest bucket (a big prefill) is not folded into it
        curve.record(64, 0.6)
    assert math.isclose(curve(8), 0.5)
    # a bucket measured slower than a larger one is capped by it (padding up is allowed)
    jag = StepCostCurve([1, 2, 4])
    jag.calibrate(lambda rows: {1: 1.0, 2: 3.0, 4: 2.0}[rows], reps=1)
    assert [t for _, t in jag.points()] == [1.0, 2.0, 2.0]
    path = tmp_path / "curve.json"
    curve.save(path)
    again = StepCostCurve.load(path, [1, 2, 4, 8])
    assert again is not None and math.isclose(again(8), curve(8))
    assert StepCostCurve.load(path, [1, 2]) is None


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("seed", range(5))
def test_step_cost_curve_incremental_medians_match_a_fresh_curve(seed, padded):
    """The curve re-takes only the medians of buckets that changed: after any sequence of
    records it equals a curve built from the same samples at once."""
    import random

    rng = random.Random(seed)
    buckets = sorted(rng.sample(range(1, 600), 12))
    curve = StepCostCurve(buckets, padded=padded)
    curve.calibrate(lambda rows: 0.001 * rows + rng.random() * 1e-4, reps=2)
    for _ in range(200):
        rows = rng.randint(1, 700)
        curve.record(rows, 0.001 * rows * (1 + rng.random()))
        if rng.random() < 0.3:
            curve(rng.randint(1, 700))  # evaluations in between must not go stale
    fresh = StepCostCurve(buckets, padded=padded)
    for dq, s in zip(fresh._samples, curve._samples):
        dq.extend(s)
    fresh._observed, fresh._calib = list(curve._observed), list(curve._calib)
    assert curve.points() == fresh.points()
    # the vectorised evaluation (the chooser's) is the scalar one, float for float
    import numpy as np

    rows = np.arange(0, 800)
    assert curve.many(rows).tolist() == [curve(int(r)) for r in rows]


def test_unobserved_buckets_follow_the_level_of_real_steps():
    """Start-up steps give the curve's shape, real steps its level: once bucket 64 is observed
    20 % cheaper than at start-up, the unobserved buckets near it are priced 20 % lower too (a
    bucket the chooser avoids would otherwise keep its start-up price forever). Higher too,
    when real steps cost more than start-up ones."""
    curve = StepCostCurve([16, 32, 64, 80, 96])
    curve.calibrate(lambda rows: 1.0 + rows / 100, reps=1)
    before = dict(curve.points())
    for _ in range(3):
        curve.record(64, 0.8 * before[64])
    after = dict(curve.points())
    assert after[64] == pytest.approx(0.8 * before[64])
    for b in (16, 32, 80, 96):
        assert after[b] == pytest.approx(0.8 * before[b])
    observe(curve, 16, before[16])  # a second observed bucket: each one scales its own side
    after = dict(curve.points())
    assert after[16] == pytest.approx(before[16])
    # 32 is nearer to 16 (unscaled) than to 64; the envelope keeps it at most 64's price
    assert after[32] == pytest.approx(min(before[32], after[64]))
    assert after[96] == pytest.approx(0.8 * before[96])
    observe(curve, 96, 3 * before[96])  # real steps dearer than start-up at 96
    assert dict(curve.points())[80] == pytest.approx(0.8 * before[80])  # nearer to 64 than 96
    fresh = StepCostCurve([16, 32, 64])
    fresh.calibrate(lambda rows: 1.0 + rows / 100, reps=1)
    observe(fresh, 16, 2.0)
    # scaled up too: left at its start-up price, 32 would look cheaper than the measured 16
    # and be tried for nothing
    assert dict(fresh.points())[32] == pytest.approx(1.32 * 2.0 / 1.16)


def test_step_cost_separates_the_context_term_from_rows(tmp_path):
    """Real steps fold into f with their context term taken out, and a step is priced as
    f(rows) + kv_cost * its context tokens: the same rows cost more with longer contexts, and a
    step of few requests with long contexts does not make rows look dear."""
    curve = StepCostCurve([16, 32, 64], kv_cost=1e-4)
    curve.calibrate(lambda rows: 0.01 * rows, reps=1)  # f: 10 ms per row
    for _ in range(3):  # 32 rows of requests reading 4,000 context tokens: 0.32 + 0.4 s
        curve.record(32, 0.72, kv_tokens=4000)
    assert curve(32) == pytest.approx(0.32)
    assert curve.at(32, 10_000, 0) == pytest.approx(1.32)
    assert curve.at(64, 0, 0) == pytest.approx(0.64)
    per_request = StepCostCurve([16, 32, 64], req_cost=0.01)
    per_request.calibrate(lambda rows: 0.01 * rows, reps=1)
    for _ in range(3):  # 32 rows of 8 requests (4 rows each): 0.32 + 0.08 s
        per_request.record(32, 0.40, requests=8)
    assert per_request(32) == pytest.approx(0.32)
    assert per_request.at(32, 0, 32) == pytest.approx(0.64)  # 32 requests of 1 row
    observe(curve, 16, 0.05, kv_tokens=10**6)  # kv_cost too high for this step: f stays positive
    assert curve(16) == pytest.approx(0.005)
    path = tmp_path / "c.json"
    curve.save(path)
    again = StepCostCurve.load(path, [16, 32, 64])
    assert again is not None and again.kv_cost == pytest.approx(1e-4)
    path.write_text(path.read_text().replace('"req_cost"', '"old"'))  # a cache from before
    assert StepCostCurve.load(path, [16, 32, 64]) is None


@pytest.mark.parametrize("padded", [False, True])
def test_step_cost_values_equal_pointwise_evaluation(padded):
    """values() prices candidate totals in one walk: float for float what __call__ gives,
    below the first bucket, between buckets, on them and past the last."""
    rng = random.Random(3)
    curve = StepCostCurve([1, 2, 4, 8, 16, 24, 40], padded=padded)
    curve.calibrate(lambda rows: 0.001 * rows + rng.random() * 1e-3, reps=2)
    for rows in (3, 16, 16, 30):
        curve.record(rows, 0.02 + rng.random() * 1e-3, kv_tokens=rows * 10)
    assert curve.values(range(1, 61)) == [curve(r) for r in range(1, 61)]
    assert curve.values([17]) == [curve(17)]
    assert curve.values([2, 16, 33, 50]) == [curve(r) for r in (2, 16, 33, 50)]


def test_a_cached_curve_with_non_positive_samples_is_recalibrated(tmp_path):
    curve = StepCostCurve([1, 2, 4])
    curve.calibrate(lambda rows: 0.01 * rows, reps=1)
    path = tmp_path / "c.json"
    curve.save(path)
    assert StepCostCurve.load(path, [1, 2, 4]) is not None
    path.write_text(path.read_text().replace("0.04", "-0.04"))
    assert StepCostCurve.load(path, [1, 2, 4]) is None


def test_one_slow_first_step_does_not_set_a_bucket():
    """A bucket's first real steps replace its start-up samples only MIN_REAL at a time: one
    step that compiled a kernel (2.5 s where steps take 6 ms) must not become its median."""
    curve = StepCostCurve([8, 16, 32], padded=True)
    curve.calibrate(lambda rows: 0.005, reps=2)
    curve.record(32, 2.5)
    assert curve(32) == pytest.approx(0.005)
    for _ in range(MIN_REAL - 1):
        curve.record(32, 0.006)
    assert curve(32) == pytest.approx(0.006)


def test_renewed_buckets_swap_their_old_window_for_the_next_real_steps():
    """renew(): a bucket's 32 old real steps (a slow spell) would outvote new ones for 16
    steps; after renew() the next MIN_REAL steps replace them, and the old median holds until
    then. Unobserved buckets are not touched (their start-up values wait for real steps)."""
    curve = StepCostCurve([8, 16, 32], padded=True)
    curve.calibrate(lambda rows: 0.005, reps=2)
    for _ in range(32):
        curve.record(16, 0.010)  # the slow spell
    assert curve(16) == pytest.approx(0.010) and curve.current(16)
    curve.record(16, 0.004)
    assert curve(16) == pytest.approx(0.010)  # one fresh step among 32 old: outvoted
    curve.renew()
    assert curve.observed(16) and not curve.current(16) and not curve.observed(32)
    for _ in range(MIN_REAL - 1):
        curve.record(16, 0.004)
    assert curve(16) == pytest.approx(0.010)  # the old median until MIN_REAL fresh steps
    curve.record(16, 0.004)
    assert curve(16) == pytest.approx(0.004) and curve.current(16)
    for _ in range(MIN_REAL - 1):
        curve.record(32, 0.007)
    assert not curve.observed(32)  # never observed: renew() left it waiting for MIN_REAL


def test_cpu_start_up_values_are_the_robust_line_and_neighbours_shift_at_most_2x():
    """CPU start-up samples are smoothed to the Theil-Sen line through their medians (one wild
    bucket does not set its neighbours' price), and an unobserved bucket moves with its real
    neighbour by at most MAX_LEVEL_SHIFT (a start-up value far too low at 64 rows made 80 rows
    look 4x dearer than they are, so auto trimmed drafts that paid at C = 16)."""
    from specserve.speculative.step_cost import MAX_LEVEL_SHIFT

    buckets = [1, 8, 16, 24, 32, 40, 48, 56, 64, 72, 80]
    wild = {40: 0.170, 64: 0.031}  # off 3x either way
    curve = StepCostCurve(buckets)
    curve.calibrate(lambda rows: wild.get(rows, 0.05 + 0.001 * rows), reps=2)
    curve.smooth_to_line()
    for b in buckets:
        assert curve(b) == pytest.approx(0.05 + 0.001 * b)
    observe(curve, 80, 0.5)  # real steps 3.8x the start-up line at 80
    assert curve(80) == pytest.approx(0.5)
    assert curve(72) == pytest.approx(MAX_LEVEL_SHIFT * (0.05 + 0.072))


def test_engine_curve_refreshes_every_few_records_and_at_once_on_a_first_real_bucket():
    """The engine's curves rebuild their envelope at most every refresh_every records (a
    rebuild each step cost ~2 % of a batch-1 step on the H200 host), but a bucket's switch to
    real steps shows at once, and after refresh_every records the curve is the exact one."""
    every = 8
    lazy = StepCostCurve([1, 2, 4, 8], padded=True, refresh_every=every)
    exact = StepCostCurve([1, 2, 4, 8], padded=True)
    for c in (lazy, exact):
        c.calibrate(lambda rows: 0.01 * rows + 0.02, reps=3)
    for c in (lazy, exact):
        observe(c, 8, 0.2)  # the switch to real steps: visible at once
    assert lazy(8) == exact(8) == 0.2
    seen_lazy, seen_exact = [], []
    for _ in range(every):
        for c in (lazy, exact):
            c.record(5, 0.9)
        seen_lazy.append(lazy(8))
        seen_exact.append(exact(8))
    assert seen_lazy[:-1] == [0.2] * (every - 1)  # stale in between
    assert len(set(seen_exact[:-1])) > 1  # while the exact curve moved
    assert seen_lazy[-1] == seen_exact[-1] > 0.2 and lazy.points() == exact.points()
