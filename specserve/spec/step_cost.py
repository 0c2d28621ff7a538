"""The step-cost curve: step time as a function of total rows, measured at start-up over the
row buckets the engine uses and refined online from the steps actually run (medians of recent
steps per bucket). Used by the verify budget to turn a candidate number of rows into time."""

from __future__ import annotations

import json
import statistics
from collections import deque
from collections.abc import Callable
from pathlib import Path


class StepCostCurve:
    def __init__(self, buckets: list[int], window: int = 32) -> None:
        self.buckets = sorted(set(buckets))
        self._samples: list[deque[float]] = [deque(maxlen=window) for _ in self.buckets]
        # buckets that have seen a real step: their start-up (or cached) samples are dropped then,
        # since a calibration run on a busy machine can be far off and would never be outvoted
        self._observed = [False] * len(self.buckets)
        self._envelope: list[float] | None = None

    # -- measurement ----------------------------------------------------------------------------
    def calibrate(self, run: Callable[[int], float], reps: int = 3) -> None:
        """run(rows) executes one synthetic step of `rows` rows and returns its seconds."""
        for i, b in enumerate(self.buckets):
            run(b)  # warm-up: first touch of buffers and kernels for this size
            for _ in range(reps):
                self._samples[i].append(run(b))
        self._envelope = None

    def record(self, rows: int, seconds: float) -> None:
        """An observed step. It refines the bucket at or above `rows`, scaled by the curve's
        own ratio so a 37-row step informs the 48-row bucket without biasing it."""
        if rows <= 0 or seconds <= 0 or rows > self.buckets[-1]:
            return  # past the largest bucket: extrapolated, never folded into it
        i = self._bucket_at_or_above(rows)
        b = self.buckets[i]
        if self._samples[i] and rows != b:
            seconds *= self(b) / max(self(rows), 1e-12)
        if not self._observed[i]:
            self._observed[i] = True
            self._samples[i].clear()
        self._samples[i].append(seconds)
        self._envelope = None

    # -- evaluation -----------------------------------------------------------------------------
    def __call__(self, rows: int) -> float:
        env = self._curve()
        bs = self.buckets
        if rows <= bs[0]:
            return env[0]
        if rows >= bs[-1]:
            return env[-1] * rows / bs[-1]
        i = self._bucket_at_or_above(rows)
        lo, hi = bs[i - 1], bs[i]
        w = (rows - lo) / (hi - lo)
        return env[i - 1] * (1 - w) + env[i] * w

    def _curve(self) -> list[float]:
        if self._envelope is None:
            med = [statistics.median(s) if s else None for s in self._samples]
            # buckets never measured borrow a neighbour, scaled by rows (a rough linear guess)
            known = [(b, m) for b, m in zip(self.buckets, med) if m is not None]

            def guess(b: int) -> float:
                if not known:
                    return float(b)
                nb, nm = min(known, key=lambda k: abs(k[0] - b))
                return nm * b / nb

            med = [m if m is not None else guess(b) for b, m in zip(self.buckets, med)]
            # padding T rows up to a larger bucket is always possible, so cost(T) is at most any
            # larger bucket's: the non-increasing-from-the-right envelope (keeps cost monotone)
            env = list(med)
            for i in range(len(env) - 2, -1, -1):
                env[i] = min(env[i], env[i + 1])
            self._envelope = env
        return self._envelope

    def _bucket_at_or_above(self, rows: int) -> int:
        for i, b in enumerate(self.buckets):
            if b >= rows:
                return i
        return len(self.buckets) - 1

    def points(self) -> list[tuple[int, float]]:
        return list(zip(self.buckets, self._curve()))

    # -- cache ----------------------------------------------------------------------------------
    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(
            json.dumps({"buckets": self.buckets, "samples": [list(s) for s in self._samples]})
        )

    @classmethod
    def load(cls, path: Path, buckets: list[int]) -> StepCostCurve | None:
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        if data.get("buckets") != sorted(set(buckets)):
            return None
        curve = cls(buckets)
        for dq, s in zip(curve._samples, data["samples"]):
            dq.extend(s)
        return curve
