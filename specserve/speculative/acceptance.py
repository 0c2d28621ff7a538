"""Online acceptance estimates for drafters without confidences of their own (n-gram), and the
calibration of a model drafter's planned confidences.

The confidence of draft j is P(draft j accepted | drafts < j accepted). Counts per position are
kept per kind of draft (n-gram: the matched length), engine-wide with PRIOR_WEIGHT
pseudo-verifications at PRIOR_RATE, and per request shrunk towards the engine-wide rate.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

PRIOR_RATE = 1.0  # a position never verified: optimistic, since only verifying it teaches
PRIOR_WEIGHT = 4.0  # pseudo-verifications behind each prior


@dataclass
class PositionCounts:
    verified: list[float] = field(default_factory=list)  # times position j was reached
    accepted: list[float] = field(default_factory=list)

    def record(
        self, num_drafts: int, num_accepted: int, weights: Sequence[float] | None = None
    ) -> None:
        """weights: what reaching position j counts (PlanCalibration: its planned confidence)."""
        grow = num_drafts - len(self.verified)
        if grow > 0:
            self.verified.extend([0.0] * grow)
            self.accepted.extend([0.0] * grow)
        for j in range(min(num_drafts, num_accepted + 1)):  # reached: drafts < j accepted
            self.verified[j] += 1.0 if weights is None else float(weights[j])
        for j in range(num_accepted):
            self.accepted[j] += 1.0

    def rate(self, j: int, prior: float) -> float:
        acc, ver = (self.accepted[j], self.verified[j]) if j < len(self.verified) else (0.0, 0.0)
        return (acc + PRIOR_WEIGHT * prior) / (ver + PRIOR_WEIGHT)


class AcceptanceEstimator:
    def __init__(self) -> None:
        self.global_rates: dict[int, PositionCounts] = {}  # kind -> engine-wide counts
        self.per_request: dict[str, dict[int, PositionCounts]] = {}  # request -> kind -> own

    def record(self, request_id: str, num_drafts: int, num_accepted: int, kind: int = 0) -> None:
        if num_drafts == 0:
            return
        self.global_rates.setdefault(kind, PositionCounts()).record(num_drafts, num_accepted)
        own = self.per_request.setdefault(request_id, {})
        own.setdefault(kind, PositionCounts()).record(num_drafts, num_accepted)

    def rates(self, n: int, kind: int = 0) -> list[float]:  # engine-wide, positions 0..n-1
        counts = self.global_rates.get(kind) or PositionCounts()
        return [counts.rate(j, PRIOR_RATE) for j in range(n)]

    def confidences(self, request_id: str, n: int, kind: int = 0) -> list[float]:
        own = self.per_request.get(request_id, {}).get(kind) or PositionCounts()
        return [own.rate(j, prior) for j, prior in enumerate(self.rates(n, kind))]

    def release(self, request_id: str) -> None:
        self.per_request.pop(request_id, None)


class PlanCalibration(PositionCounts):
    """A model drafter plans with its previous drafts' confidences, which overstate what
    verifies: position j's factor is accepted / planned over the drafts that reached j (the
    counts' rate with `verified` weighted by the planned confidence, prior 1); the plan uses
    min(1, factor_j * c_j)."""

    def apply(self, conf: np.ndarray) -> np.ndarray:
        """[n, k] planned confidences -> calibrated ones."""
        f = np.array([self.rate(j, 1.0) for j in range(conf.shape[1])])
        return np.minimum(1.0, conf * f[None, :])
