"""The host work a synchronous step adds to its launch-to-readback (scheduling, the ledger,
drafting, the caller's handling of the outputs), by load: what overlap would have hidden.

That work grows with the requests in the step (H200, 8B, golden drafts: ~0.6 ms at 16 requests,
1.1-1.9 ms at 64, ~6 ms at 256). One window over all loads priced each load with another's
host work after every change of load: the sweep's interleaved runs (C = 16, then 64) started
each C = 64 run with C = 16's 0.6 ms, which made draft rows look dear next to the step's fixed
cost, and the chooser trimmed them (104 of 256 kept where all of them paid). So each load range
(requests in powers of two) keeps its own window, and a range without samples borrows the
nearest one's."""

from __future__ import annotations

import statistics
from collections import deque

WINDOW = 16  # samples per load range
MIN_SAMPLES = 3  # samples a range (or its renewal) needs before its median is used


def load_range(requests: int) -> int:
    """1 -> 0, 2 -> 1, 3-4 -> 2, 5-8 -> 3, ..., 129-256 -> 8."""
    return max(0, requests - 1).bit_length()


class HostOverhead:
    def __init__(self) -> None:
        self._windows: dict[int, deque[float]] = {}
        self._medians: dict[int, float] = {}  # of ranges with MIN_SAMPLES, cached until a record
        # ranges whose window the next MIN_SAMPLES samples replace (renew()), and those samples
        self._fresh: dict[int, list[float]] = {}
        self._last = 0  # the range of the newest sample

    def record(self, seconds: float, requests: int) -> None:
        if seconds < 0:
            return
        r = self._last = load_range(requests)
        window = self._windows.setdefault(r, deque(maxlen=WINDOW))
        fresh = self._fresh.get(r)
        if fresh is not None:
            fresh.append(seconds)
            if len(fresh) < MIN_SAMPLES:
                return  # the old median stands until the renewal has enough samples
            del self._fresh[r]
            window.clear()
            window.extend(fresh)
        else:
            window.append(seconds)
        if len(window) >= MIN_SAMPLES:
            self._medians[r] = statistics.median(window)
        else:
            self._medians.pop(r, None)

    def at(self, requests: int) -> float:
        """Seconds of host work a synchronous step of `requests` requests adds (recent median
        of its load range, else of the nearest range with enough samples; 0.0 before any)."""
        r = load_range(requests)
        m = self._medians.get(r)
        if m is not None:
            return m
        if not self._medians:
            # no range has MIN_SAMPLES yet: the few samples there are beat nothing
            window = self._windows.get(r) or next(iter(self._windows.values()), None)
            return statistics.median(window) if window else 0.0
        near = min(self._medians, key=lambda j: (abs(j - r), j))
        return self._medians[near]

    @property
    def latest(self) -> float:
        """The estimate at the load of the newest sample (a metric)."""
        return self.at(1 << self._last)

    def renew(self) -> None:
        """The samples held are old: each range's window is replaced by its next MIN_SAMPLES
        samples, and keeps its median until then (like StepCostCurve.renew)."""
        for r in self._windows:
            self._fresh[r] = []
