"""The verify budget's chooser and split, judged by outcomes: the chosen rows maximise expected
tokens per second against the curve, zero confidence gives no drafts, split_rows is the global
order of survivals and reads nothing back to the host."""

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specserve.runner.device_split import split_rows
from specserve.speculative.step_cost import WINDOW
from specserve.speculative.verify_budget import EXPLORE_EVERY, VerifyBudget, choose, survivals
from tests.speculative.conftest import conf_matrix, curve_of

BUCKETS = [1, 2, 4, 8, 16, 24, 32]
conf_value = st.one_of(st.sampled_from([0.0, 0.5, 1.0]), st.floats(0.0, 1.0))


@st.composite
def workloads(draw, max_n: int = 3, max_k: int = 3):
    n = draw(st.integers(1, max_n))
    k = draw(st.integers(0, max_k))
    conf = np.array(draw(st.lists(conf_value, min_size=n * k, max_size=n * k))).reshape(n, k)
    return survivals(conf)


@st.composite
def curves(draw):
    """A non-decreasing curve (padded or linear) from random positive increments."""
    steps = draw(st.lists(st.floats(0.0, 5.0), min_size=len(BUCKETS), max_size=len(BUCKETS)))
    base = draw(st.floats(0.1, 10.0))
    prices = list(itertools.accumulate(steps, initial=base))[1:]
    return curve_of(BUCKETS, lambda b: prices[BUCKETS.index(b)], draw(st.booleans()))


@given(st.lists(st.lists(st.floats(allow_nan=True, allow_infinity=True), min_size=3, max_size=3)))
def test_survivals_are_running_products_of_confidences_clamped_to_0_1(rows):
    """Any float a drafter hands over (NaN, infinities, out of range) is read as its clamp to
    [0, 1], NaN as 0; survivals never rise along a request's drafts."""
    conf = np.array(rows, dtype=np.float64).reshape(len(rows), 3)
    got = survivals(conf)
    clamped = [[0.0 if np.isnan(c) else min(max(c, 0.0), 1.0) for c in r] for r in rows]
    want = np.array([list(itertools.accumulate(r, lambda a, b: a * b)) for r in clamped])
    assert np.array_equal(got, want.reshape(got.shape))
    assert np.all(np.diff(got, axis=-1) <= 0.0)


def _rate(surv: np.ndarray, m: tuple[int, ...], base: int, times) -> float:
    tokens = surv.shape[0] + sum(surv[i, :mi].sum() for i, mi in enumerate(m))
    return tokens / float(times(np.array([base + sum(m)]))[0])


@settings(max_examples=300, deadline=None)
@given(workloads(), curves(), st.integers(0, 4), st.integers(0, 40))
def test_the_choice_maximises_expected_tokens_per_second(surv, curve, extra_base, max_rows):
    """Against every prefix per request (brute force) within the row limit."""
    n, k = surv.shape
    base = n + extra_base
    got = choose(surv, base, curve.times, max_rows)
    m = got.num_verify
    assert m.sum() == got.total and base + got.total <= max(base, max_rows)
    assert all(surv[i, j] > 0 for i in range(n) for j in range(m[i]))  # a prefix of real drafts
    assert got.expected_tokens == pytest.approx(n + sum(surv[i, : m[i]].sum() for i in range(n)))
    best = max(
        _rate(surv, mm, base, curve.times)
        for mm in itertools.product(range(k + 1), repeat=n)
        if base + sum(mm) <= max(base, max_rows)
    )
    assert _rate(surv, tuple(m), base, curve.times) == pytest.approx(best, rel=1e-9)


@given(st.integers(1, 8), st.integers(1, 5), st.booleans())
def test_zero_confidence_gives_no_drafts(n, k, padded):
    flat = curve_of(BUCKETS, lambda b: 1.0, padded)  # extra rows free: only zero gain stops them
    conf = np.zeros((n, k))
    conf[:, 1:] = 1.0  # the first draft is surely wrong: the later ones never count
    got = choose(survivals(conf), n, flat.times, 64)
    assert got.total == 0 and not got.num_verify.any()


@settings(max_examples=200, deadline=None)
@given(workloads(max_n=4, max_k=4), curves(), st.floats(0.0, 1.0))
def test_scaling_all_survivals_down_never_raises_the_total(surv, curve, scale):
    n = surv.shape[0]
    hi = choose(surv, n, curve.times, 64)
    lo = choose(surv * scale, n, curve.times, 64)
    if lo.total > hi.total:  # only a floating-point tie may flip it
        assert lo.expected_tokens / lo.step_time == pytest.approx(
            (n + scale * (hi.expected_tokens - n)) / hi.step_time, rel=1e-9
        )


@settings(max_examples=200, deadline=None)
@given(workloads(max_n=5, max_k=4), st.data())
def test_the_choice_respects_each_request_s_room_and_the_row_limit(surv, data):
    n, k = surv.shape
    surv = np.where(surv > 1e-6, surv, 0.0)  # a survival adding nothing to n in floats is a tie
    room = data.draw(st.lists(st.integers(0, k), min_size=n, max_size=n))
    max_rows = data.draw(st.integers(n, n * (1 + k)))
    free = curve_of(BUCKETS, lambda b: 1.0)
    got = choose(surv, n, free.times, max_rows, room)
    assert all(got.num_verify <= np.array(room, dtype=np.int64))
    assert n + got.total <= max_rows
    # where nothing but room limits it, every draft with room is taken (rows are free)
    want = choose(surv, n, free.times, n * (1 + k), room)
    assert want.total == sum(int(np.count_nonzero(surv[i, : room[i]] > 0)) for i in range(n))


def _brute_split(surv: np.ndarray, total: int) -> list[int]:
    n, k = surv.shape
    order = sorted((-surv[i, j], j, i) for i in range(n) for j in range(k) if surv[i, j] > 0)
    out = [0] * n
    for _a, _j, i in order[:total]:
        out[i] += 1
    return out


@settings(max_examples=300, deadline=None)
@given(workloads(max_n=6, max_k=5), st.integers(0, 40), st.booleans())
def test_split_rows_is_the_global_order_of_survivals(surv, total, as_tensor):
    t = torch.from_numpy(surv)
    got = split_rows(t, torch.tensor(total) if as_tensor else total)
    assert got.dtype == torch.int64 and got.shape == (surv.shape[0],)
    assert got.tolist() == _brute_split(surv, total)


@settings(max_examples=200, deadline=None)
@given(workloads(max_n=6, max_k=5), curves())
def test_split_rows_of_the_chosen_total_is_the_choice(surv, curve):
    """The host's choice (CPU synchronous steps) and the device's split of its total agree."""
    n = surv.shape[0]
    got = choose(surv, n, curve.times, 128)
    assert split_rows(torch.from_numpy(surv), got.total).tolist() == got.num_verify.tolist()


def test_split_rows_reads_nothing_back_to_the_host():
    """On meta tensors (no data at all) any .item(), .tolist() or data-dependent shape fails:
    split_rows runs there, so it can run inside a CUDA graph, with the total a device tensor."""
    surv = torch.empty(7, 4, device="meta")
    got = split_rows(surv, torch.empty((), dtype=torch.int64, device="meta"))
    assert got.device.type == "meta" and got.shape == (7,) and got.dtype == torch.int64

    from torch.utils._python_dispatch import TorchDispatchMode

    class NoSync(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            assert "_local_scalar_dense" not in str(func), "a host sync"
            return func(*args, **(kwargs or {}))

    with NoSync():
        split_rows(torch.rand(5, 3).cumprod(1), torch.tensor(6))


def test_survivals_clamp_and_multiply():
    got = survivals([[0.5, 2.0, 0.5], [-1.0, 0.9, float("nan")]])
    assert got.tolist() == [[0.5, 0.5, 0.25], [0.0, 0.0, 0.0]]


def test_verify_budget_allot_keeps_metrics_consistent_within_room():
    budget = VerifyBudget(curve_of(BUCKETS, lambda b: 1.0 + 0.01 * b), max_rows=32)
    # request 1 has nothing to draft, request 2's first draft is sure to be wrong
    surv = survivals(conf_matrix([[0.9, 0.9, 0.9], [], [0.0, 1.0]], 3))
    keep = budget.allot(surv, 3)
    assert keep[1] == 0 and keep[2] == 0 and keep[0] > 0
    assert budget.offered_rows == 3 and budget.chosen_rows == sum(keep)
    assert budget.expected_accepted == pytest.approx(sum(0.9 ** (j + 1) for j in range(keep[0])))
    assert budget.seqlens_q() == {1: 2, 1 + keep[0]: 1}
    assert budget.allot(surv, 3, room=[1, 3, 3])[0] == 1  # a request's room caps its drafts


def _golden_llm(rate: float):
    from tests.engine.conftest import make_llm

    spec = {"method": "golden", "num_speculative_tokens": 3, "acceptance_rate": rate}
    return make_llm(max_num_seqs=4, speculative_config=spec)


@pytest.mark.parametrize("rate", [0.0, 1.0])
def test_the_engine_verifies_no_draft_of_zero_confidence_and_sure_ones_at_batch_1(rate):
    """verify_budget "auto" plans every drafting round before drafting: golden drafts at
    confidence 0 are never drafted nor verified (a plain step each, exploration included), sure
    ones at batch 1 are (a verify row costs little next to a step's fixed cost on CPU)."""
    from specserve import SamplingParams
    from tests.engine.conftest import prompts_of

    llm = _golden_llm(rate)
    drafter, calls = llm.engine.drafter, []
    real = drafter.propose
    drafter.propose = lambda seqs, limits: calls.append(list(limits)) or real(seqs, limits)
    gold = [(7 * j) % 400 + 3 for j in range(24)]
    sp = SamplingParams(max_tokens=24, temperature=0.0, golden_token_ids=gold)
    out = llm.generate(prompts_of([9]), sp, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == gold
    m = llm.get_metrics()
    if rate == 0.0:
        assert calls == []  # planned at zero: the drafter never ran
        assert m["verify_budget_offered_draft_rows"] == 0
        assert m["verify_budget_chosen_draft_rows"] == 0 and m["spec_draft_tokens"] == 0
        assert m["verify_budget_seqlens_q"] == {1: m["num_steps"] - 1}  # all but the prefill
    else:
        assert calls and m["verify_budget_offered_draft_rows"] > 0
        assert m["spec_accepted_tokens"] == m["spec_draft_tokens"] > 0


def _model_budget() -> VerifyBudget:
    """A model drafter's budget whose steps are priced 1 + 0.01 rows."""
    return VerifyBudget(curve_of(BUCKETS, lambda b: 1.0 + 0.01 * b, padded=True), 32, True)


def _plans(budget: VerifyBudget, conf: float, steps: int, extra: float, may: bool = True):
    """Plans of 4 requests at confidence conf, each step then run and timed (a drafting step
    dearer by `extra`), the drafts it verifies accepted as their survivals say."""
    surv = survivals(np.full((4, 3), conf))
    has = np.zeros(4, dtype=bool)
    out = []
    for _ in range(steps):
        plan = budget.plan(np.full((4, 3), conf), 4, [3] * 4, has, may)
        rows = 4 + sum(plan.keep)
        assert all(k == 0 for k, h in zip(plan.keep, has) if not h)  # only drafts it has
        seconds = 1.0 + 0.01 * rows + extra * plan.draft
        if has.all() and plan.draft:  # a steady drafting step
            accepted = sum(surv[i, :m].sum() for i, m in enumerate(plan.keep))
            budget.observe_drafting(4, 4 + round(accepted), rows, seconds)
        elif not plan.draft:
            budget.observe_step(rows, seconds)
        has[:] = plan.draft
        out.append(plan)
    return out


def _plain_runs(plans) -> list[int]:
    """Lengths of the runs of plans that did not draft, each ended by one that did."""
    runs, n = [], 0
    for p in plans:
        if p.draft:
            runs, n = runs + [n] * (n > 0), 0
        else:
            n += 1
    return runs


def test_drafting_is_chosen_when_it_pays_and_real_steps_correct_a_wrong_start():
    """Confident drafts and a chain that costs little: every step drafts and verifies its
    drafts. A chain dearer than its drafts yield: the optimistic start drafts, its real steps
    measure what it yields a second, and from then on drafting only re-measures that, ever
    more rarely."""
    cheap = _plans(_model_budget(), 0.9, 40, extra=0.1)
    assert all(p.draft for p in cheap) and all(sum(p.keep) > 0 for p in cheap[1:])
    dear = _plans(_model_budget(), 0.9, 400, extra=5.0)
    first_plain = next(i for i, p in enumerate(dear) if not p.draft)
    assert first_plain == 2  # the first steady drafting step measured it
    assert sum(p.draft for p in dear[first_plain:]) < 0.1 * (400 - first_plain)


@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(1, 40), st.floats(1.0, 6.0), st.floats(0.5, 5.0)),
        min_size=1,
        max_size=WINDOW,
    ),
    st.floats(1.0, 3.0),
)
def test_more_tokens_or_fewer_seconds_never_stop_drafting(steps, scale):
    """Drafting pays by its steps' tokens a second against plain steps of the same requests:
    the same steps emitting more tokens, or taking less time, never turn it from paying to
    not; scaled down both ways, never from not paying to paying."""

    def pays(tok_scale: float, sec_scale: float) -> bool:
        budget = VerifyBudget(curve_of(BUCKETS, lambda b: 1.0 + 0.05 * b, padded=True), 64, True)
        for n, tokens_per_req, seconds in steps:
            tokens = round(n * tokens_per_req * tok_scale)
            budget.observe_drafting(n, tokens, 2 * n, seconds * sec_scale)
        return budget.drafting_pays()

    base = pays(1.0, 1.0)
    assert pays(scale, 1.0) >= base and pays(1.0, 1 / scale) >= base
    assert pays(1 / scale, 1.0) <= base and pays(1.0, scale) <= base


@pytest.mark.parametrize("requests", [4, 64])
def test_a_drafting_step_is_priced_by_what_it_cost_not_by_its_rows(requests):
    """A drafter's chain runs for every request, so a drafting step of many requests costs
    more than the curve's price of its rows, which sees only the target's rows (the curve of
    a few requests' verify rows). With the yield of 1.8 tokens a request, drafting pays where
    its steps cost 1.5x a plain one (4 requests) and not where they cost 2.5x (64); the
    drafting steps' rows are priced as allot then sees them: the curve plus the measured
    excess."""
    budget = VerifyBudget(curve_of(BUCKETS, lambda b: 1.0 + 0.01 * b, padded=True), 400, True)
    budget.curve.observe = lambda rows, seconds: None  # the start-up prices stay
    plain = budget.curve(requests)
    for _ in range(WINDOW):
        cost = (1.5 if requests == 4 else 2.5) * plain
        budget.observe_drafting(requests, round(1.8 * requests), 2 * requests, cost)
    assert budget.drafting_pays() == (requests == 4)
    excess = budget.chain_seconds()
    assert excess == pytest.approx(cost - budget.curve(2 * requests))


def test_zero_confidence_drafts_only_to_explore_and_ever_more_rarely():
    """Drafts that cannot be accepted never pay for a chain: after the first measurement,
    drafting only re-measures its yield, after EXPLORE_EVERY - 1 plain plans, then twice as
    many each time, up to EXPLORE_EVERY ** 2; nothing is verified; a step that may not draft
    (drafts in flight to settle) never does."""
    plans = _plans(_model_budget(), 0.0, 3000, extra=0.0)
    runs = _plain_runs(plans)
    assert runs[:6] == [EXPLORE_EVERY * 2**j - 1 for j in range(5)] + [EXPLORE_EVERY**2 - 1]
    assert all(sum(p.keep) == 0 for p in plans)
    assert not any(p.draft for p in _plans(_model_budget(), 1.0, 50, 0.0, may=False))
