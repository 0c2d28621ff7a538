"""How far real step periods run above the cost model's prediction, on average.

The step-cost curves and the synchronous overhead are medians of recent steps: one slow step
(a compile, a host hiccup) must not move them. But throughput is set by the mean period, and
the two kinds of step the budget weighs against each other have different tails. A synchronous
speculative step exposes every host hiccup; an overlapped plain step hides most of them behind
the step in flight. Median against median therefore flatters speculation exactly where the two
are close.

Seen on the H200 (golden drafts at acceptance 0.5, 64 concurrent requests). The
level's final curves price the best speculative step ~5 % below plain decoding. Auto still
speculated in 132 of 160 steps per run and ran at 0.88 of plain. Its synchronous steps took
~10.5 ms each on average (the run's 1.62 s less ~0.2 s for its 28 other steps), against ~9.3 ms
priced for them: ~13 % above, and enough to explain the loss. That reading is rough; tails are
the likely cause of the gap, not a proven one. The next device session measures the factors
(`verify_budget_*_period_bias` in the sweep JSON).

Each kind of step keeps the ratio of its real period to the period predicted for it just
before it was recorded. The mean of the recent ratios, each clamped so that one compile cannot
swing it, scales that kind's price when speculation as a whole is weighed against plain
decoding.
"""

from __future__ import annotations

from collections import deque

WINDOW = 32
MIN_SAMPLES = 8  # ratios before the factor departs from 1
LOW, HIGH = 0.5, 2.0  # one ratio's clamp


class PeriodBias:
    def __init__(self, window: int = WINDOW) -> None:
        self._ratios: deque[float] = deque(maxlen=window)
        self._sum = 0.0

    def record(self, actual: float, predicted: float) -> None:
        if actual <= 0 or predicted <= 0:
            return
        if len(self._ratios) == self._ratios.maxlen:
            self._sum -= self._ratios[0]
        ratio = min(max(actual / predicted, LOW), HIGH)
        self._ratios.append(ratio)
        self._sum += ratio

    @property
    def factor(self) -> float:
        """Mean real / predicted period over the window (1.0 until MIN_SAMPLES)."""
        n = len(self._ratios)
        return self._sum / n if n >= MIN_SAMPLES else 1.0
