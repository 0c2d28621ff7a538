"""AcceptanceEstimator: rates by kind of draft, learned from outcomes (host and device alike);
PlanCalibration: planned confidences mapped to what verifies, learned from outcomes."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specserve.engine.sequence import Sequence
from specserve.engine.slots import DraftSlotPool
from specserve.sampling_params import SamplingParams
from specserve.speculative.acceptance import PRIOR_RATE, AcceptanceEstimator, PlanCalibration
from specserve.speculative.ngram import NgramDrafter
from specserve.speculative.ngram_device import NgramDeviceDrafter


def _outcome(rng: np.random.Generator, rate: float, k: int) -> int:
    """Drafts accepted of k, each accepted with `rate` once the ones before it were."""
    acc = 0
    while acc < k and rng.random() < rate:
        acc += 1
    return acc


def test_kinds_are_estimated_apart():
    """Drafts of a kind that verifies well are priced above those of one that does not, in the
    engine-wide rates and in a request's own (whose prior is its kind's rate)."""
    rng, est = np.random.default_rng(0), AcceptanceEstimator()
    for i in range(3000):
        est.record(f"r{i % 8}", 4, _outcome(rng, 0.85, 4), kind=4)
        est.record(f"r{i % 8}", 4, _outcome(rng, 0.3, 4), kind=2)
    long, short = est.rates(4, kind=4), est.rates(4, kind=2)
    np.testing.assert_allclose(long, 0.85, atol=0.04)
    np.testing.assert_allclose(short[:2], 0.3, atol=0.06)
    assert est.confidences("r0", 4, kind=4)[0] > 0.7 > 0.45 > est.confidences("r0", 4, kind=2)[0]
    # a kind never verified starts optimistic (only verifying it teaches), a new request at
    # its kind's engine-wide rate
    assert est.rates(2, kind=3) == [PRIOR_RATE] * 2
    assert est.confidences("new", 4, kind=4) == pytest.approx(long)


def test_one_kind_behaves_as_one_estimate():
    """Negative control: drafts of one kind learn what the kindless estimate learned."""
    rng, est = np.random.default_rng(1), AcceptanceEstimator()
    for _ in range(2000):
        est.record("r", 3, _outcome(rng, 0.6, 3))
    np.testing.assert_allclose(est.rates(3), 0.6, atol=0.04)
    est.release("r")
    assert est.confidences("r", 3) == pytest.approx(est.rates(3))


def _seq(tokens: list[int], rid: str) -> Sequence:
    return Sequence(rid, None, tokens, SamplingParams(max_tokens=8), 0)


def test_ngram_plans_only_the_drafts_it_has():
    """Planned confidences are 0 past the drafts a match gives (none without a match), so the
    budget never prices rows that will not exist."""
    d = NgramDrafter(2, 3)
    assert d.plan_confidences(_seq([1, 2, 3, 4], "a"), 4) == [0.0] * 4
    plan = d.plan_confidences(_seq([5, 6, 7, 5, 6], "b"), 4)  # "5 6" continues with 7 5 6
    assert plan[:3] == [PRIOR_RATE] * 3 and plan[3] == 0.0
    ((drafts, conf),) = d.propose([_seq([5, 6, 7, 5, 6], "b")], [4])
    assert drafts == [7, 5, 6] and conf == plan[:3]


def test_ngram_learns_per_matched_length():
    """Outcomes are recorded under the kind of the drafts they verified."""
    d = NgramDrafter(2, 3)
    short = _seq([5, 6, 9, 9, 5, 6], "s")  # matches 2 tokens
    long = _seq([1, 2, 3, 4, 1, 2, 3], "l")  # matches 3
    d.propose([short, long], [2, 2])
    d.observe(short, 2, 0)
    d.observe(long, 2, 2)
    assert d.acceptance.rates(1, kind=2)[0] < PRIOR_RATE
    assert d.acceptance.rates(1, kind=3)[0] == PRIOR_RATE


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(1, 3), st.integers(0, 4), st.integers(0, 4), st.integers(1, 5)),
        min_size=1,
        max_size=25,
    )
)
def test_device_ngram_learns_what_the_host_estimate_learns(steps):
    """Each (kind, drafts, accepted, rows) verified on the device moves its rates as the host
    estimator's engine-wide rates move for the drafts really verified."""
    k, host = 4, AcceptanceEstimator()
    pool = DraftSlotPool(1, k, 8, False, torch.device("cpu"))
    dev = NgramDeviceDrafter(pool, 1, 3, 16)
    for kind, n, acc, rows in steps:
        pool.draft_ids[1] = torch.tensor([7] * n + [-1] * (k - n))
        dev.kind[1] = kind
        dev.learn(torch.tensor([1]), torch.tensor([rows]), torch.tensor([acc]))
        real = min(n, rows - 1)
        host.record("r", real, min(acc, real), kind)
    for kind in range(4):
        want = host.rates(k, kind)
        np.testing.assert_allclose(dev.rates()[kind].tolist(), want, rtol=1e-6)


def _simulate(planned: float, true_rate: float, rounds: int, seed: int = 0) -> PlanCalibration:
    """Rounds of k = 3 drafts planned at `planned`, each accepted with `true_rate` in turn."""
    rng, cal = np.random.default_rng(seed), PlanCalibration()
    for _ in range(rounds):
        acc = 0
        while acc < 3 and rng.random() < true_rate:
            acc += 1
        cal.record(3, acc, [planned] * 3)
    return cal


def test_no_outcomes_leave_the_plan_as_it_is():
    conf = np.array([[0.9, 0.5, 0.2], [1.0, 1.0, 0.0]])
    np.testing.assert_array_equal(PlanCalibration().apply(conf), conf)


def test_an_overconfident_plan_is_scaled_to_the_observed_rate():
    cal = _simulate(planned=0.9, true_rate=0.45, rounds=4000)
    got = cal.apply(np.full((1, 3), 0.9))[0]
    np.testing.assert_allclose(got, 0.45, atol=0.03)


def test_a_calibrated_plan_stays_as_it_is():
    """Negative control: confidences that match what verifies are not moved."""
    cal = _simulate(planned=0.6, true_rate=0.6, rounds=4000, seed=1)
    np.testing.assert_allclose(cal.apply(np.full((1, 3), 0.6))[0], 0.6, atol=0.03)


def test_positions_never_reached_keep_their_confidence():
    cal = PlanCalibration()
    for _ in range(50):
        cal.record(3, 0, [0.9, 0.9, 0.9])  # the first draft always rejected
    got = cal.apply(np.full((1, 3), 0.9))[0]
    assert got[0] < 0.1
    np.testing.assert_array_equal(got[1:], 0.9)


@settings(max_examples=50, deadline=None)
@given(
    st.lists(
        st.tuples(st.lists(st.floats(0, 1), min_size=1, max_size=5), st.integers(0, 5)),
        max_size=30,
    ),
    st.lists(st.floats(0, 1), min_size=5, max_size=5),
)
def test_calibrated_confidences_are_probabilities(rounds, plan):
    cal = PlanCalibration()
    for planned, acc in rounds:
        cal.record(len(planned), min(acc, len(planned)), planned)
    got = cal.apply(np.array([plan]))
    assert np.all(got >= 0) and np.all(got <= 1)
    assert np.all(got[np.array([plan]) == 0] == 0)  # zero stays zero: never planned
