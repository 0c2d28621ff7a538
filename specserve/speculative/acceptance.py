"""Online acceptance estimates for drafters without confidences of their own (n-gram).

The confidence of draft j is the conditional rate P(draft j accepted | drafts < j accepted): the
verify budget multiplies them into survivals. Engine-wide counts per position, with PRIOR_WEIGHT
pseudo-verifications at PRIOR_RATE; a request's own counts, with PRIOR_WEIGHT pseudo-verifications
at the engine-wide rate (a new request starts at the engine's rate and moves to its own).
"""

from __future__ import annotations

from dataclasses import dataclass, field

PRIOR_RATE = 1.0  # a position never verified: optimistic, since only verifying it teaches
PRIOR_WEIGHT = 4.0  # pseudo-verifications behind each prior


@dataclass
class PositionCounts:
    verified: list[float] = field(default_factory=list)  # times position j was reached
    accepted: list[float] = field(default_factory=list)

    def record(self, num_drafts: int, num_accepted: int) -> None:
        grow = num_drafts - len(self.verified)
        if grow > 0:
            self.verified.extend([0.0] * grow)
            self.accepted.extend([0.0] * grow)
        for j in range(min(num_drafts, num_accepted + 1)):  # reached: drafts < j accepted
            self.verified[j] += 1.0
        for j in range(num_accepted):
            self.accepted[j] += 1.0

    def rate(self, j: int, prior: float) -> float:
        acc, ver = (self.accepted[j], self.verified[j]) if j < len(self.verified) else (0.0, 0.0)
        return (acc + PRIOR_WEIGHT * prior) / (ver + PRIOR_WEIGHT)

    def samples(self, j: int) -> float:
        return self.verified[j] if j < len(self.verified) else 0.0


class AcceptanceEstimator:
    def __init__(self) -> None:
        self.global_rates = PositionCounts()
        self.per_request: dict[str, PositionCounts] = {}

    def record(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        if num_drafts == 0:
            return
        self.global_rates.record(num_drafts, num_accepted)
        self.per_request.setdefault(request_id, PositionCounts()).record(num_drafts, num_accepted)

    def confidences(self, request_id: str, n: int) -> list[float]:
        own = self.per_request.get(request_id) or PositionCounts()
        return [own.rate(j, self.global_rates.rate(j, PRIOR_RATE)) for j in range(n)]

    def release(self, request_id: str) -> None:
        self.per_request.pop(request_id, None)
