import itertools
import math
import random

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from specserve.spec.step_cost import MIN_REAL, StepCostCurve
from specserve.spec.verify_budget import choose_verify_budget, survivals

conf_lists = st.lists(st.lists(st.floats(0.0, 1.0), min_size=0, max_size=4), min_size=1, max_size=4)
cost_points = st.lists(st.floats(0.5, 3.0), min_size=16, max_size=16)


def _cost_fn(points):
    # a jagged, non-monotone measured curve; the chooser sees it through StepCostCurve's envelope
    curve = StepCostCurve(list(range(1, 17)))
    for rows, t in enumerate(points, start=1):
        curve._samples[rows - 1].append(t * (1 + rows / 8))
    return curve


def _observe(curve: StepCostCurve, rows: int, seconds: float, **fixed: int) -> None:
    """Enough real steps of one bucket for them to replace its start-up samples."""
    for _ in range(MIN_REAL):
        curve.record(rows, seconds, **fixed)


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


def test_budget_policy_explores_so_a_pessimistic_start_is_corrected():
    from specserve.spec.budget_policy import EXPLORE_EVERY, VerifyBudgetPolicy

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
    _observe(policy.curve, 1, 1.0)
    assert policy.trim([object()], [[5, 6, 7]], [[0.9, 0.9, 0.9]]) == [3]


def test_overlapped_plain_decoding_is_priced_with_its_own_curve():
    """With a host drafter, no drafts at all means the step can run overlapped (host work hidden):
    when that plain step is cheap enough, it beats the speculative choice priced on the
    synchronous curve; when it is not, the drafts stay."""
    from specserve.spec.budget_policy import VerifyBudgetPolicy

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
    slow_drafter.record_sync_overhead(1.0)
    assert slow_drafter.trim(ready, drafts, confs) == [0] * 32


def test_high_load_shrinks_speculation_to_nothing():
    # 64 decode requests, cost linear in rows: a 40% draft is not worth a 1/64 longer step... at
    # this load each extra row costs ~1/64 of the step but brings 0.4/64 of its tokens
    cost = lambda rows: 1.0 + rows / 16  # noqa: E731
    choice = choose_verify_budget([[0.4, 0.2]] * 64, 64, cost, 512)
    assert sum(choice.num_verify) == 0
    low_load = choose_verify_budget([[0.9, 0.8, 0.7]], 1, cost, 512)
    assert low_load.num_verify == [3]


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


def test_the_end_of_a_pause_is_decided_with_the_last_rounds_confidences():
    """keeps_pausing prices the requests decoding now with the confidences of the last round
    that drafted: still plain under the same load, speculate again once the load falls; no round
    with drafts at all means "draft for real"."""
    from types import SimpleNamespace

    from specserve.spec.budget_policy import VerifyBudgetPolicy

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

    from specserve.spec.budget_policy import EXPLORE_EVERY, VerifyBudgetPolicy

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


@pytest.mark.parametrize("seed", range(20))
def test_vectorised_chooser_equals_the_loop(seed):
    """Past SMALL candidates the chooser runs in numpy: same choice as the Python loop, on random
    confidences (zeros, ones, ties included) and a jagged measured curve."""
    import random

    from specserve.spec import verify_budget as vb

    rng = random.Random(seed)
    n = rng.randint(20, 300)
    pick = [0.0, 0.5, 1.0, 0.25]
    confs = [
        [rng.choice(pick) if rng.random() < 0.3 else rng.random() for _ in range(rng.randint(0, 6))]
        for _ in range(n)
    ]
    curve = StepCostCurve(sorted(rng.sample(range(1, 2000), 15)))
    curve.calibrate(lambda rows: 0.01 + rows * 1e-5 * (1 + rng.random()), reps=2)
    base = n + rng.randint(0, 100)
    max_rows = base + rng.randint(0, 1500)
    assert sum(len(c) for c in confs) > vb.SMALL
    for step_time in (curve, lambda r: curve(r)):  # vectorised curve, and a plain callable
        got = vb.choose_verify_budget(confs, base, step_time, max_rows)
        assert got == vb._choose_loop(confs, base, step_time, max_rows)


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
    _observe(curve, 16, before[16])  # a second observed bucket: each one scales its own side
    after = dict(curve.points())
    assert after[16] == pytest.approx(before[16])
    # 32 is nearer to 16 (unscaled) than to 64; the envelope keeps it at most 64's price
    assert after[32] == pytest.approx(min(before[32], after[64]))
    assert after[96] == pytest.approx(0.8 * before[96])
    _observe(curve, 96, 3 * before[96])  # real steps dearer than start-up at 96
    assert dict(curve.points())[80] == pytest.approx(0.8 * before[80])  # nearer to 64 than 96
    fresh = StepCostCurve([16, 32, 64])
    fresh.calibrate(lambda rows: 1.0 + rows / 100, reps=1)
    _observe(fresh, 16, 2.0)
    # scaled up too: left at its start-up price, 32 would look cheaper than the measured 16
    # and be tried for nothing
    assert dict(fresh.points())[32] == pytest.approx(1.32 * 2.0 / 1.16)


def test_the_chooser_prices_whole_step_periods():
    """The host work around a synchronous step (ledger, drafting, scheduling) is a fixed cost per
    step: next to it, extra verify rows are cheaper than the device curve alone says. Without
    it a 50 % draft per request is not worth its rows here; with it, it is."""
    from types import SimpleNamespace

    from specserve.spec.budget_policy import VerifyBudgetPolicy

    sched = SimpleNamespace(running=[], waiting=[], max_num_seqs=64)
    curve = StepCostCurve([16, 32, 64])
    curve.calibrate(lambda rows: rows / 16, reps=1)  # device time: 1.0 at 16 rows, 2.0 at 32
    ready, drafts, confs = [object()] * 16, [[1]] * 16, [[0.5]] * 16
    p = VerifyBudgetPolicy.from_curves(SimpleNamespace(scheduler=sched), 512, curve)
    assert p.trim(ready, drafts, confs) == [0] * 16  # 16 / 1.0 beats 24 / 2.0
    p.record_sync_overhead(2.0)
    assert p.trim(ready, drafts, confs) == [1] * 16  # 24 / 4.0 beats 16 / 3.0


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
    _observe(curve, 16, 0.05, kv_tokens=10**6)  # kv_cost too high for this step: f stays positive
    assert curve(16) == pytest.approx(0.005)
    path = tmp_path / "c.json"
    curve.save(path)
    again = StepCostCurve.load(path, [16, 32, 64])
    assert again is not None and again.kv_cost == pytest.approx(1e-4)
    path.write_text(path.read_text().replace('"req_cost"', '"old"'))  # a cache from before
    assert StepCostCurve.load(path, [16, 32, 64]) is None


def test_calibration_measures_the_context_cost_and_rows_apart():
    """Start-up calibration against a device whose step costs 1 ms + 2 ms per row + 5 us per
    context token + 0.3 ms per request: kv_cost, req_cost and f come out right, whatever
    contexts and request counts the synthetic steps use."""
    from types import SimpleNamespace

    from specserve.spec import budget_policy as bp

    calls = []

    def synthetic(self, rows, context=bp.CALIBRATION_CONTEXT, n_req=None):
        n_req = n_req or min(rows, 8)
        calls.append((rows, context, n_req))
        return 1e-3 + 2e-3 * rows + 5e-6 * n_req * context + 3e-4 * n_req

    eng = SimpleNamespace(
        config=SimpleNamespace(max_num_seqs=8),
        max_num_batched_tokens=64,
        max_model_len=2048,
        slot_pool=SimpleNamespace(k=3),
    )
    policy = bp.VerifyBudgetPolicy.__new__(bp.VerifyBudgetPolicy)
    policy.engine = eng
    policy._synthetic_step = synthetic.__get__(policy)
    policy.engine.runner = SimpleNamespace(graphs=None)
    curve = policy._load_or_calibrate([1, 8, 16, 40], None)
    assert curve.kv_cost == pytest.approx(5e-6)
    assert curve.req_cost == pytest.approx(3e-4)
    for rows in (1, 8, 16, 40):
        assert curve(rows) == pytest.approx(1e-3 + 2e-3 * rows)
    assert {bp.CALIBRATION_CONTEXT, bp.KV_CALIBRATION_CONTEXT} <= {c for _, c, _ in calls}
    assert (8, bp.CALIBRATION_CONTEXT, 2) in calls  # verify-shaped: 4 rows per request


def test_long_contexts_make_verify_rows_relatively_cheap():
    """Context reads are a fixed cost of the step (the requests do not change with the rows
    chosen): next to a large one, drafts that did not pay with short contexts pay."""
    from types import SimpleNamespace

    from specserve.spec.budget_policy import VerifyBudgetPolicy

    sched = SimpleNamespace(running=[], waiting=[], max_num_seqs=64)
    curve = StepCostCurve([16, 32, 64], kv_cost=1e-4)
    curve.calibrate(lambda rows: rows / 16, reps=1)  # f: 1.0 at 16 rows, 2.0 at 32
    p = VerifyBudgetPolicy.from_curves(SimpleNamespace(scheduler=sched), 512, curve)
    drafts, confs = [[1]] * 16, [[0.5]] * 16
    short = [SimpleNamespace(num_tokens=100)] * 16  # 1,600 tokens: +0.16 s
    assert p.trim(short, drafts, confs) == [0] * 16  # 16 / 1.16 beats 24 / 2.16
    long = [SimpleNamespace(num_tokens=2000)] * 16  # 32,000 tokens: +3.2 s
    assert p.trim(long, drafts, confs) == [1] * 16  # 24 / 5.2 beats 16 / 4.2


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


def test_per_request_cost_is_fixed_within_a_decision():
    """f(rows) holds no per-request work: a decision over 16 requests adds req_cost * 16 to
    every candidate, so a draft that does not pay against f alone pays next to it."""
    from types import SimpleNamespace

    from specserve.spec.budget_policy import VerifyBudgetPolicy

    sched = SimpleNamespace(running=[], waiting=[], max_num_seqs=64)
    drafts, confs = [[1]] * 16, [[0.5]] * 16
    ready = [SimpleNamespace(num_tokens=100)] * 16
    for req_cost, kept in ((0.0, [0] * 16), (0.25, [1] * 16)):
        curve = StepCostCurve([16, 32, 64], req_cost=req_cost)
        curve.calibrate(lambda rows: rows / 16, reps=1)  # f: 1.0 at 16 rows, 2.0 at 32
        p = VerifyBudgetPolicy.from_curves(SimpleNamespace(scheduler=sched), 512, curve)
        # without: 16 / 1.0 beats 24 / 2.0; with +4.0: 24 / 6.0 beats 16 / 5.0
        assert p.trim(ready, drafts, confs) == kept


def test_fixed_terms_measured_too_high_never_make_the_curve_negative():
    """A start-up kv_cost above what large synthetic steps cost (seen on the CPU: 27 us/token,
    so 256 requests x 128 tokens 'cost' more than the whole 0.83 s step) leaves f a share of
    every step, and real steps folded in through the curve's own ratios stay finite and
    positive (they compounded to -1e307 and NaN before)."""
    from types import SimpleNamespace

    from specserve.spec import budget_policy as bp

    def synthetic(self, rows, context=bp.CALIBRATION_CONTEXT, n_req=None):
        n_req = n_req or min(rows, 256)
        if context > bp.CALIBRATION_CONTEXT:  # context cost grows faster at long contexts
            return 0.05 + 3e-3 * rows + 3e-5 * n_req * context
        return 0.05 + 3e-3 * rows + 1e-5 * n_req * context

    eng = SimpleNamespace(
        config=SimpleNamespace(max_num_seqs=256),
        max_num_batched_tokens=1280,
        max_model_len=2048,
        slot_pool=SimpleNamespace(k=4),
        runner=SimpleNamespace(graphs=None),
    )
    policy = bp.VerifyBudgetPolicy.__new__(bp.VerifyBudgetPolicy)
    policy.engine = eng
    policy._synthetic_step = synthetic.__get__(policy)
    buckets = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
    curve = policy._load_or_calibrate(buckets, None)
    assert curve.kv_cost * 256 * bp.CALIBRATION_CONTEXT > synthetic(policy, 256)
    assert all(t > 0 for _, t in curve.points())
    rng = random.Random(0)
    for _ in range(300):
        rows = rng.randint(1, 600)
        n = min(rows, 256)
        curve.record(rows, synthetic(policy, rows, n_req=n), kv_tokens=n * 200, requests=n)
    assert all(math.isfinite(t) and t > 0 for _, t in curve.points())
    assert all(math.isfinite(curve(r)) and curve(r) > 0 for r in range(1, 700))


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


def test_cpu_start_up_values_are_the_robust_line_and_neighbours_shift_at_most_2x():
    """CPU start-up samples are smoothed to the Theil-Sen line through their medians (one wild
    bucket does not set its neighbours' price), and an unobserved bucket moves with its real
    neighbour by at most MAX_LEVEL_SHIFT (a start-up value far too low at 64 rows made 80 rows
    look 4x dearer than they are, so auto trimmed drafts that paid at C = 16)."""
    from specserve.spec.step_cost import MAX_LEVEL_SHIFT

    buckets = [1, 8, 16, 24, 32, 40, 48, 56, 64, 72, 80]
    wild = {40: 0.170, 64: 0.031}  # off 3x either way
    curve = StepCostCurve(buckets)
    curve.calibrate(lambda rows: wild.get(rows, 0.05 + 0.001 * rows), reps=2)
    curve.smooth_to_line()
    for b in buckets:
        assert curve(b) == pytest.approx(0.05 + 0.001 * b)
    _observe(curve, 80, 0.5)  # real steps 3.8x the start-up line at 80
    assert curve(80) == pytest.approx(0.5)
    assert curve(72) == pytest.approx(MAX_LEVEL_SHIFT * (0.05 + 0.072))
