"""PlanCalibration: planned confidences mapped to what verifies, learned from outcomes."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from specserve.speculative.acceptance import PlanCalibration


def _simulate(planned: float, true_rate: float, rounds: int, seed: int = 0) -> PlanCalibration:
    """Rounds of k = 3 drafts planned at `planned`, each accepted with `true_rate` in turn."""
    rng, cal = np.random.default_rng(seed), PlanCalibration()
    for _ in range(rounds):
        acc = 0
        while acc < 3 and rng.random() < true_rate:
            acc += 1
        cal.record([planned] * 3, 3, acc)
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
        cal.record([0.9, 0.9, 0.9], 3, 0)  # the first draft always rejected
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
        cal.record(planned, len(planned), min(acc, len(planned)))
    got = cal.apply(np.array([plan]))
    assert np.all(got >= 0) and np.all(got <= 1)
    assert np.all(got[np.array([plan]) == 0] == 0)  # zero stays zero: never planned
