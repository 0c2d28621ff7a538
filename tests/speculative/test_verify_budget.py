"""The chooser: against brute force, monotone, prefix, bucket tops on padded curves."""

import itertools
import math
import random

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from specserve.speculative.step_cost import StepCostCurve
from specserve.speculative.verify_budget import choose_verify_budget, survivals

conf_lists = st.lists(st.lists(st.floats(0.0, 1.0), min_size=0, max_size=4), min_size=1, max_size=4)
cost_points = st.lists(st.floats(0.5, 3.0), min_size=16, max_size=16)


def _cost_fn(points):
    # a jagged, non-monotone measured curve; the chooser sees it through StepCostCurve's envelope
    curve = StepCostCurve(list(range(1, 17)))
    for rows, t in enumerate(points, start=1):
        curve._samples[rows - 1].append(t * (1 + rows / 8))
    return curve


def _objective(conf, ms, base, cost):
    tokens = len(conf) + sum(sum(survivals(c)[:m]) for c, m in zip(conf, ms))
    return tokens / cost(base + sum(ms))


@settings(max_examples=300, deadline=None)
@given(conf_lists, cost_points, st.integers(1, 4), st.integers(1, 16))
def test_chooser_matches_brute_force(conf, points, base, max_rows):
    cost = _cost_fn(points)
    base = min(base, max_rows)
    choice = choose_verify_budget(conf, base, cost, max_rows)
    best = max(
        _objective(conf, ms, base, cost)
        for ms in itertools.product(*[range(len(c) + 1) for c in conf])
        if base + sum(ms) <= max_rows
    )
    assert math.isclose(_objective(conf, choice.num_verify, base, cost), best, rel_tol=1e-9)
    # prefix per request, within each request's drafts, within the budget
    assert all(0 <= m <= len(c) for m, c in zip(choice.num_verify, conf))
    assert base + sum(choice.num_verify) <= max_rows
    assert choice.total_rows == base + sum(choice.num_verify)


@settings(max_examples=300, deadline=None)
@given(conf_lists, cost_points, st.integers(1, 4), st.floats(1.0, 3.0))
def test_scaling_all_survivals_up_never_shrinks_the_budget(conf, points, base, factor):
    cost = _cost_fn(points)
    low = choose_verify_budget(conf, base, cost, 64)
    # survivals multiplied by a common factor: scale the first confidence of every request
    higher = [([min(1.0, c[0] * factor)] + c[1:]) if c else c for c in conf]
    scaled_ok = all(not c or c[0] * factor <= 1.0 for c in conf)
    high = choose_verify_budget(higher, base, cost, 64)
    if scaled_ok:
        assert sum(high.num_verify) >= sum(low.num_verify)


def test_zero_confidence_verifies_nothing_and_certain_drafts_are_taken():
    flat = lambda rows: 1.0  # noqa: E731 - rows are free: only confidence matters
    choice = choose_verify_budget(
        [[0.0, 0.9, 0.9], [1.0, 1.0]], base_rows=2, step_time=flat, max_rows=64
    )
    assert choice.num_verify == [0, 2]
    steep = lambda rows: float(rows)  # noqa: E731 - each row costs as much as a step
    assert choose_verify_budget([[0.3, 0.3]], 1, steep, 64).num_verify == [0]


def test_high_load_shrinks_speculation_to_nothing():
    # 64 decode requests, cost linear in rows: a 40% draft is not worth a 1/64 longer step... at
    # this load each extra row costs ~1/64 of the step but brings 0.4/64 of its tokens
    cost = lambda rows: 1.0 + rows / 16  # noqa: E731
    choice = choose_verify_budget([[0.4, 0.2]] * 64, 64, cost, 512)
    assert sum(choice.num_verify) == 0
    low_load = choose_verify_budget([[0.9, 0.8, 0.7]], 1, cost, 512)
    assert low_load.num_verify == [3]


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("seed", range(20))
def test_vectorised_chooser_equals_the_loop(seed, padded):
    """Past SMALL candidates the chooser runs in numpy: same choice as the Python loop, on random
    confidences (zeros, ones, ties included) and a jagged measured curve, padded (CUDA graphs)
    or not, bare or with the policy's per-step offset; asked twice (the candidate times are
    cached per curve envelope), and again after the curve changed."""

    from specserve.speculative import verify_budget as vb
    from specserve.speculative.verify_budget import OffsetCurve

    rng = random.Random(seed)
    n = rng.randint(20, 300)
    pick = [0.0, 0.5, 1.0, 0.25]
    confs = [
        [rng.choice(pick) if rng.random() < 0.3 else rng.random() for _ in range(rng.randint(0, 6))]
        for _ in range(n)
    ]
    curve = StepCostCurve(sorted(rng.sample(range(1, 2000), 15)), padded=padded)
    curve.calibrate(lambda rows: 0.01 + rows * 1e-5 * (1 + rng.random()), reps=2)
    base = n + rng.randint(0, 100)
    max_rows = base + rng.randint(0, 1500)
    assert sum(len(c) for c in confs) > vb.SMALL
    for record in (False, True):
        if record:  # the curve moves: cached candidate times must not survive it
            for rows in curve.buckets * 3:  # a bucket takes real steps from its third on
                curve.record(rows, 0.01 + rows * 3e-3)  # rows 100x dearer: fewer drafts
        # vectorised curve, with an offset, and a plain callable
        for step_time in (curve, OffsetCurve(curve, 0.003), lambda r: curve(r)):
            want = vb._choose_loop(confs, base, step_time, max_rows)
            for _ in range(2):
                assert vb.choose_verify_budget(confs, base, step_time, max_rows) == want


def test_padded_curve_is_a_step_function_and_the_chooser_fills_buckets():
    """With CUDA graphs a step of T rows runs padded to its bucket: T rows cost the bucket's
    time, so a draft row inside an already-paid bucket is free and the first row past a bucket
    costs the whole next one. Linear pricing gets both wrong."""
    costs = {4: 1.0, 8: 1.3, 16: 2.5}
    curve = StepCostCurve(list(costs), padded=True)
    curve.calibrate(costs.__getitem__, reps=1)
    assert [curve(r) for r in (1, 4, 5, 7, 8, 9, 16)] == [1.0, 1.0, 1.3, 1.3, 1.3, 2.5, 2.5]
    linear = StepCostCurve(list(costs))
    linear.calibrate(costs.__getitem__, reps=1)
    assert linear(6) == pytest.approx(1.15)
    # 4 decode requests, one draft each: base 4 rows (bucket 4), any draft needs bucket 8
    steep = [[0.6], [0.3], [0.1], [0.05]]
    assert choose_verify_budget(steep, 4, linear, 64).num_verify == [1, 0, 0, 0]
    # ...which really costs bucket 8: 4.6 tokens / 1.3 < 4 / 1.0. Padded pricing declines.
    assert choose_verify_budget(steep, 4, curve, 64).num_verify == [0, 0, 0, 0]
    # once bucket 8 is worth paying, every draft that fits it rides along for free
    flat = [[0.6], [0.3], [0.25], [0.25]]
    assert choose_verify_budget(flat, 4, linear, 64).num_verify == [1, 0, 0, 0]
    assert choose_verify_budget(flat, 4, curve, 64).num_verify == [1, 1, 1, 1]


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.lists(st.floats(0.0, 1.0), max_size=5), min_size=1, max_size=40),
    st.lists(st.floats(0.5, 3.0), min_size=7, max_size=7),
    st.integers(1, 60),
    st.integers(1, 200),
)
# at the largest bucket f was env * 40 / 40, one ulp above the same bucket's value at 39 rows
@example([[1.0] * 4] + [[1.0] * 5] * 3 + [[1.0] * 4 + [1e-308]], [1.0] * 6 + [0.6], 16, 40)
def test_padded_chooser_scores_bucket_tops_only_and_matches_brute_force(conf, pts, base, max_rows):
    """On a padded curve the chooser scores only stops() (each bucket's top, every total past
    the largest bucket), through both the loop and numpy: the choice is the one of scoring
    every total."""
    curve = StepCostCurve([1, 2, 4, 8, 16, 24, 40], padded=True)
    level = dict(zip(curve.buckets, pts))
    curve.calibrate(lambda rows: level[rows] * (1 + rows / 8), reps=1)
    stops = curve.stops(base, base + 50)
    assert stops == sorted(set(stops)) and stops[-1] == base + 50
    assert set(stops) >= {b for b in curve.buckets if base <= b <= base + 50}
    got = choose_verify_budget(conf, base, curve, max_rows)
    every = choose_verify_budget(conf, base, lambda rows: curve(rows), max_rows)  # no stops()
    assert got.num_verify == every.num_verify
    assert got.total_rows == every.total_rows
    assert got.expected_tokens == pytest.approx(every.expected_tokens)


@pytest.mark.parametrize("n", [3, 40])
def test_confidences_out_of_range_are_clipped_like_in_range_ones(n):
    """A drafter's confidence above 1 or below 0 counts as 1 or 0, in the loop and in numpy."""
    from specserve.speculative import verify_budget as vb

    rng = random.Random(n)
    raw = [[rng.uniform(-0.5, 1.5) for _ in range(4)] for _ in range(n)]
    clipped = [[min(max(c, 0.0), 1.0) for c in conf] for conf in raw]

    def step_time(rows: int) -> float:
        return 1.0 + rows / 8

    for choose in (vb._choose_loop, vb.choose_verify_budget):
        assert choose(raw, n, step_time, 4 * n) == choose(clipped, n, step_time, 4 * n)
    assert vb.choose_verify_budget(raw, n, step_time, 4 * n) == vb._choose_loop(
        clipped, n, step_time, 4 * n
    )
