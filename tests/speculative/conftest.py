"""Helpers shared by the verify-budget tests."""

import numpy as np

from specserve.speculative.step_cost import SWEEP_REPS, StepCostCurve


def curve_of(buckets: list[int], cost, padded: bool = False) -> StepCostCurve:
    """A start-up curve whose bucket prices are cost(rows)."""
    return StepCostCurve(buckets, [float(cost(b)) for b in buckets], padded)


def run_steps(curve: StepCostCurve, rows: int, cost, n: int = 1 + SWEEP_REPS) -> None:
    """n real steps of `rows` rows costing cost(rows) (the first is the bucket's warm-up; by
    default the rest are just enough to price the bucket)."""
    for _ in range(n):
        curve.observe(rows, float(cost(rows)))


def conf_matrix(confs: list[list[float]], k: int) -> np.ndarray:
    """[n, k] confidences, zero past each request's drafts."""
    return np.array([c + [0.0] * (k - len(c)) for c in confs], dtype=np.float64).reshape(-1, k)


class FixedDrafter:
    """A model-like drafter (its confidences come with its drafts) that proposes the same
    tokens every step, at one confidence."""

    has_q = False

    def __init__(self, tokens, confidence=0.5):
        self.tokens, self.confidence = tokens, confidence

    def propose(self, seqs, limits):
        return [(self.tokens[:k], [self.confidence] * min(k, len(self.tokens))) for k in limits]

    def observe(self, seq, nd, na):
        pass

    def release(self, seq):
        pass

    def plan_confidences(self, seq, k):
        return None
