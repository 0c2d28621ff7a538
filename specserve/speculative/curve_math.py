"""Small robust helpers of the step-cost curve: a line through noisy start-up medians, and the
nearest measured bucket of each bucket."""

from __future__ import annotations

import statistics
from collections.abc import Sequence


def theil_sen(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """(slope, intercept) of the line with the median of the pairwise slopes (pairs of equal x
    left out) and the median intercept: one wild point moves it little."""
    n = len(xs)
    slopes = [
        (ys[j] - ys[i]) / (xs[j] - xs[i])
        for i in range(n)
        for j in range(i + 1, n)
        if xs[j] != xs[i]
    ]
    slope = statistics.median(slopes)
    return slope, statistics.median(y - slope * x for x, y in zip(xs, ys))


def nearest_flagged(buckets: Sequence[int], flags: Sequence[bool]) -> list[int | None]:
    """For each bucket, the nearest flagged bucket by rows (ties: the smaller), or None:
    one pass each way."""
    bs, n = buckets, len(buckets)
    left: list[int | None] = [None] * n
    right: list[int | None] = [None] * n
    last = None
    for i in range(n):
        last = i if flags[i] else last
        left[i] = last
    last = None
    for i in range(n - 1, -1, -1):
        last = i if flags[i] else last
        right[i] = last
    out: list[int | None] = []
    for i in range(n):
        cands = [j for j in (left[i], right[i]) if j is not None]
        out.append(min(cands, key=lambda j: abs(bs[j] - bs[i])) if cands else None)
    return out
