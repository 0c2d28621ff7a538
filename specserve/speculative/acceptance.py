"""Online estimate of how likely a model-free draft is to be accepted at each position.

Per request when it has history, falling back to the engine-wide rate. The value at position j is
the conditional rate P(draft j accepted | drafts < j accepted): the verify budget multiplies them
into survival probabilities.
"""

from __future__ import annotations

from dataclasses import dataclass, field

PRIOR_ACCEPT = 1.0  # pseudo-counts: an unseen position starts at 1/2
PRIOR_TOTAL = 2.0
MIN_REQUEST_SAMPLES = 4  # below this many verifications a request borrows the global rate


@dataclass
class PositionRates:
    verified: list[float] = field(default_factory=list)  # times position j was reached
    accepted: list[float] = field(default_factory=list)

    def record(self, num_drafts: int, num_accepted: int) -> None:
        grow = num_drafts - len(self.verified)
        if grow > 0:
            self.verified.extend([0.0] * grow)
            self.accepted.extend([0.0] * grow)
        # position j is reached when drafts < j were accepted
        for j in range(min(num_drafts, num_accepted + 1)):
            self.verified[j] += 1.0
        for j in range(num_accepted):
            self.accepted[j] += 1.0

    def rate(self, j: int) -> float:
        if j >= len(self.verified):
            return PRIOR_ACCEPT / PRIOR_TOTAL
        return (self.accepted[j] + PRIOR_ACCEPT) / (self.verified[j] + PRIOR_TOTAL)

    def samples(self, j: int) -> float:
        return self.verified[j] if j < len(self.verified) else 0.0


class AcceptanceEstimator:
    def __init__(self) -> None:
        self.global_rates = PositionRates()
        self.per_request: dict[str, PositionRates] = {}

    def record(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        if num_drafts == 0:
            return
        self.global_rates.record(num_drafts, num_accepted)
        self.per_request.setdefault(request_id, PositionRates()).record(num_drafts, num_accepted)

    def confidences(self, request_id: str, n: int) -> list[float]:
        own = self.per_request.get(request_id)
        out = []
        for j in range(n):
            src = (
                own
                if own is not None and own.samples(j) >= MIN_REQUEST_SAMPLES
                else self.global_rates
            )
            out.append(src.rate(j))
        return out

    def release(self, request_id: str) -> None:
        self.per_request.pop(request_id, None)
