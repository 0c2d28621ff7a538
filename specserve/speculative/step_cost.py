"""The step-cost model: step time = f(total rows) + kv_cost * (context tokens the step's requests
read) + req_cost * (requests in the step). f is measured at start-up over the row buckets the
engine uses and refined online from the steps actually run (medians of recent steps per bucket);
kv_cost and req_cost are measured at start-up. Used by the verify budget to turn a candidate
number of rows into time.

Why the two fixed terms: attention reads every request's whole context, so two steps of the same
rows cost differently with different requests behind them (30 requests verifying 80 rows vs 64
requests decoding 64 rows; short contexts at start-up vs long ones late in a run), and per-request
work (attention tiles, split-KV combines) likewise. One decision varies only the rows of a fixed
set of requests: folding these terms into f made extra verify rows look as dear as extra requests
(start-up steps are decode-shaped, one request per row; verify steps carry 1 + k rows each).
"""

from __future__ import annotations

import bisect
import json
import math
import statistics
from collections import deque
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import NamedTuple

import numpy as np

from specserve.speculative.curve_math import nearest_flagged, theil_sen

# f keeps at least this share of a step's time when the fixed terms are taken out: fixed costs
# measured too high (the CPU's context cost varies 2-3x between start-ups) must not drive f to
# zero or below, where the curve's own ratios blow up
MIN_ROW_SHARE = 0.1
MIN_REAL = 3  # real steps a bucket needs before they replace its start-up samples
MAX_LEVEL_SHIFT = 2.0  # unobserved buckets move at most this factor with a real neighbour
# the engine's curves re-take their medians and envelope at most every this many recorded steps:
# a rebuild is ~45 us of Python over ~50 buckets, and each step both records and asks, so exact
# refreshing cost ~2 % of a 6 ms batch-1 verify step on the H200 host; over a window of 32 steps
# a median lags little in 8
ENGINE_REFRESH_EVERY = 8
# up to this many totals the curve prices them in a Python loop: numpy's ~10 calls of a few us
# each cost more (CPU, batch 1: 35 us, and it ran every 8 steps when the envelope was rebuilt)
SMALL_STOPS = 64


class _Stops(NamedTuple):
    """The totals of a (lo, hi) range that can win and f at each; lists too, never mutated."""

    rows: np.ndarray  # int64
    times: np.ndarray
    row_list: list[int]
    time_list: list[float]


class StepCostCurve:
    def __init__(
        self,
        buckets: list[int],
        window: int = 32,
        padded: bool = False,
        kv_cost: float = 0.0,
        req_cost: float = 0.0,
        refresh_every: int = 1,
    ) -> None:
        self.buckets = sorted(set(buckets))
        self.kv_cost = kv_cost  # seconds per context token read (0: f holds everything)
        self.req_cost = req_cost  # seconds per request in the step
        # padded: steps of up to the largest bucket run padded to their bucket (CUDA graphs and
        # their eager twin), so the cost is a step function - a row that stays inside its
        # bucket costs nothing. Otherwise (CPU: exact rows) linear between buckets.
        self.padded = padded
        self._samples: list[deque[float]] = [deque(maxlen=window) for _ in self.buckets]
        # buckets that have seen a real step: their start-up (or cached) samples are dropped then,
        # since a calibration run on a busy machine can be far off and would never be outvoted
        self._observed = [False] * len(self.buckets)
        self._first: list[list[float]] = [[] for _ in self.buckets]  # real steps before MIN_REAL
        # observed buckets whose window the next MIN_REAL real steps replace (renew())
        self._renewing = [False] * len(self.buckets)
        # the start-up median of each bucket once observed. Buckets not yet observed are priced
        # at their start-up value scaled by the real/start-up ratio of the nearest observed
        # bucket: the start-up shape, at the level of real steps (which carry sampling, verify
        # and bookkeeping kernels the synthetic ones lack). Scaling only down (real steps
        # cheaper) made every unobserved bucket below an observed one look cheaper than it when
        # real steps cost more, so the chooser tried each once with fewer drafts (H200, C = 16,
        # R = 0.8: 46 steps instead of 44); a bucket priced too high still gets measured through
        # exploration.
        self._calib: list[float | None] = [None] * len(self.buckets)
        # per-bucket medians, refreshed only for the buckets a sample changed: the budget asks
        # for the curve every step, and re-taking ~170 medians each time cost ~1 ms per step
        self._medians: list[float | None] = [None] * len(self.buckets)
        self._dirty: set[int] = set(range(len(self.buckets)))
        self._envelope: list[float] | None = None
        # stop_values' results for the envelope they were computed on (a rebuild makes a new list)
        self._stops_env: list[float] | None = None
        self._stops_cache: dict[tuple[int, int], _Stops] = {}
        # records since the envelope was last built; it is rebuilt (when asked for) once this
        # reaches refresh_every, or at once after a structural change (a bucket's first real
        # steps, calibration, loading)
        self.refresh_every = max(1, refresh_every)
        self._pending = 0
        # nearest observed bucket of each bucket, for the observed set it was taken for
        self._near_key: tuple[bool, ...] | None = None
        self._near: list[int | None] = []

    # -- measurement ----------------------------------------------------------------------------
    def calibrate(self, run: Callable[[int], float], reps: int = 3) -> None:
        """run(rows) executes one synthetic step of `rows` rows and returns its seconds."""
        for i, b in enumerate(self.buckets):
            run(b)  # warm-up: first touch of buffers and kernels for this size
            for _ in range(reps):
                self._samples[i].append(run(b))
            self._dirty.add(i)
        self._envelope = None

    def smooth_to_line(self) -> None:
        """Replace the start-up samples by the robust line through their medians. For unpadded
        (CPU) steps, whose time grows about linearly with rows: single start-up samples on a
        busy machine were off 3x (40 rows: 170 ms, 48 rows: 54 ms), which the scaling of
        unobserved buckets by their neighbours' real/start-up ratio then carried over."""
        if len(self.buckets) < 3 or any(self._observed) or not all(self._samples):
            return
        medians = [statistics.median(s) for s in self._samples]
        slope, intercept = theil_sen(self.buckets, medians)
        floor = min(medians)  # the line may dip below zero at few rows
        for i, b in enumerate(self.buckets):
            n = len(self._samples[i])
            self._samples[i].clear()
            self._samples[i].extend([max(intercept + slope * b, floor)] * n)
            self._dirty.add(i)
        self._envelope = None

    def record(self, rows: int, seconds: float, kv_tokens: int = 0, requests: int = 0) -> None:
        """An observed step of `rows` rows of `requests` requests that read `kv_tokens` context
        tokens. It refines f at the bucket at or above `rows`, scaled by the curve's own ratio so
        a 37-row step informs the 48-row bucket without biasing it."""
        if rows <= 0 or seconds <= 0 or rows > self.buckets[-1]:
            return  # past the largest bucket: extrapolated, never folded into it
        seconds = self.rows_part(seconds, kv_tokens, requests)
        i = self._bucket_at_or_above(rows)
        b = self.buckets[i]
        if self._samples[i] and rows != b:
            # the curve's shape as last built (a few records stale at most): asking self() here
            # would rebuild it on every record
            at_b, at_rows = self._shape_at(b), self._shape_at(rows)
            if at_b > 0 and at_rows > 0:
                seconds *= at_b / at_rows
        if not self._observed[i] or self._renewing[i]:
            # a bucket switches to real (or fresh) steps once it has MIN_REAL of them: alone, one
            # slow first step (a kernel compiled for a new shape: 2.5 s on the H200) would be its
            # median
            self._first[i].append(seconds)
            if len(self._first[i]) < MIN_REAL:
                return
            if not self._observed[i]:
                self._observed[i] = True
                if self._samples[i]:
                    self._calib[i] = statistics.median(self._samples[i])
            self._renewing[i] = False
            self._samples[i].clear()
            self._samples[i].extend(self._first[i])
            self._first[i].clear()
            self._pending = self.refresh_every  # a bucket switched to real steps: rebuild now
        else:
            self._samples[i].append(seconds)
        self._dirty.add(i)
        self._pending += 1
        if self._pending >= self.refresh_every:
            self._envelope = None

    def renew(self) -> None:
        """The real steps held are old (measured under a load or a machine state that may be
        gone): each observed bucket's window is replaced by its next MIN_REAL real steps, and
        keeps its old median until then."""
        for i, seen in enumerate(self._observed):
            if seen and not self._renewing[i]:
                self._renewing[i] = True
                self._first[i].clear()

    def current(self, rows: int) -> bool:
        """Is f(rows) a median of real steps, and none of them awaiting renewal?"""
        return self.observed(rows) and not self._renewing[self._bucket_at_or_above(rows)]

    def _shape_at(self, rows: int) -> float:
        return self(rows) if self._envelope is None else self._eval(self._envelope, rows)

    def rows_part(self, seconds: float, kv_tokens: int, requests: int) -> float:
        """A measured step's f: its seconds less the fixed terms, at least MIN_ROW_SHARE of it."""
        return max(seconds - self.fixed(kv_tokens, requests), MIN_ROW_SHARE * seconds)

    # -- evaluation -----------------------------------------------------------------------------
    def fixed(self, kv_tokens: int, requests: int) -> float:
        """The part of a step's time set by its requests, whatever their rows."""
        return self.kv_cost * kv_tokens + self.req_cost * requests

    def at(self, rows: int, kv_tokens: int, requests: int) -> float:
        """Seconds of a step of `rows` rows of `requests` requests reading `kv_tokens` tokens."""
        return self(rows) + self.fixed(kv_tokens, requests)

    def __call__(self, rows: int) -> float:
        """f(rows): the part of a step's time that depends on its rows."""
        return self._eval(self._curve(), rows)

    def _eval(self, env: list[float], rows: int) -> float:
        bs = self.buckets
        if rows <= bs[0]:
            return env[0]
        if rows > bs[-1]:  # past the largest bucket (at it: its own value, exactly)
            return env[-1] * rows / bs[-1]
        i = self._bucket_at_or_above(rows)
        if self.padded:
            return env[i]
        lo, hi = bs[i - 1], bs[i]
        w = (rows - lo) / (hi - lo)
        return env[i - 1] * (1 - w) + env[i] * w

    def values(self, rows: Iterable[int]) -> list[float]:
        """[self(r) for r in rows] (rows ascending) with the same float arithmetic, in one walk
        over the buckets: the chooser prices many candidate totals a step (a call each ~5 us)."""
        env, bs = self._curve(), self.buckets
        out, i = [], 0
        for r in rows:
            if r <= bs[0]:
                out.append(env[0])
            elif r > bs[-1]:
                out.append(env[-1] * r / bs[-1])
            else:
                while bs[i] < r:
                    i += 1
                if self.padded:
                    out.append(env[i])
                else:
                    b0, b1 = bs[i - 1], bs[i]
                    w = (r - b0) / (b1 - b0)
                    out.append(env[i - 1] * (1 - w) + env[i] * w)
        return out

    def stops(self, lo: int, hi: int) -> list[int] | None:
        """The totals in lo..hi that can maximise tokens / time (ascending), or None for all of
        them. Padded, f is constant over each bucket's rows, where more rows only bring more
        tokens: the top of each bucket's segment (and every total past the largest bucket,
        where f grows with rows) is enough. ~30 totals instead of 257 at 64 requests x 4
        drafts, 1,025 at 256: the chooser runs every step."""
        if not self.padded:
            return None
        bs = self.buckets
        out = bs[bisect.bisect_left(bs, lo) : bisect.bisect_right(bs, hi)]
        if hi < bs[-1] and (not out or out[-1] != hi):
            out.append(hi)  # hi inside a bucket's segment: the top of what is reachable
        out.extend(range(max(lo, bs[-1] + 1), hi + 1))
        return out

    def stop_values(self, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        """The totals of lo..hi that can win (stops(), or all of them) and f at each, as arrays.
        The chooser asks with the same lo and hi step after step (the same requests decoding)
        while the curve changes at most every refresh_every records: cached per envelope, it
        costs a dict lookup instead of ~40 us of numpy at 64 requests x 4 drafts."""
        hit = self._stops(lo, hi)
        return hit.rows, hit.times

    def stop_lists(self, lo: int, hi: int) -> tuple[list[int], list[float]]:
        """stop_values as Python lists (the chooser's loop for a few drafts: numpy's per-call
        overhead would be most of its time)."""
        hit = self._stops(lo, hi)
        return hit.row_list, hit.time_list

    def _stops(self, lo: int, hi: int) -> _Stops:
        env = self._curve()
        if self._stops_env is not env:
            self._stops_env, self._stops_cache = env, {}
        hit = self._stops_cache.get((lo, hi))
        if hit is None:
            totals = self.stops(lo, hi)
            row_list = list(range(lo, hi + 1)) if totals is None else totals
            if len(row_list) <= SMALL_STOPS:
                time_list = self.values(row_list)
                rows, times = np.array(row_list, dtype=np.int64), np.array(time_list)
            else:
                rows = np.array(row_list, dtype=np.int64)
                times = self.many(rows)
                time_list = times.tolist()
            rows.flags.writeable = times.flags.writeable = False  # shared by later calls
            if len(self._stops_cache) >= 64:  # bounded: loads vary over a run
                self._stops_cache.clear()
            hit = self._stops_cache[(lo, hi)] = _Stops(rows, times, row_list, time_list)
        return hit

    def many(self, rows: np.ndarray) -> np.ndarray:
        """self(r) for every r of an int array, with the same float arithmetic."""
        env = np.asarray(self._curve())
        bs = np.asarray(self.buckets)
        r = rows.astype(np.float64)
        i = np.clip(np.searchsorted(bs, rows, side="left"), 1, len(bs) - 1)
        lo, hi = bs[i - 1], bs[i]
        w = (r - lo) / np.maximum(hi - lo, 1)
        out = env[i] if self.padded else env[i - 1] * (1 - w) + env[i] * w
        out = np.where(rows <= bs[0], env[0], out)
        return np.where(rows > bs[-1], env[-1] * r / bs[-1], out)

    def refresh(self) -> None:
        """Rebuild the envelope now if records made it stale (else the next question does)."""
        self._curve()

    def _curve(self) -> list[float]:
        if self._envelope is None:
            self._pending = 0
            for i in self._dirty:
                s = self._samples[i]
                self._medians[i] = statistics.median(s) if s else None
            self._dirty.clear()
            med = list(self._medians)
            ref = [o and c is not None for o, c in zip(self._observed, self._calib)]
            if any(ref):
                near = self._nearest_cached(ref)
                for i, m in enumerate(med):
                    j = near[i]
                    if m is not None and not self._observed[i] and j is not None:
                        # j is observed, so never rescaled itself: med[j] is a measured median.
                        # The shift is bounded: a start-up value far off at j alone (a large
                        # fixed term taken out of a small step) must not move its neighbours 4x
                        level = med[j] / self._calib[j]
                        med[i] = m * min(max(level, 1 / MAX_LEVEL_SHIFT), MAX_LEVEL_SHIFT)
            # buckets never measured borrow the nearest measured neighbour, scaled by rows (a
            # rough linear guess)
            if None in med:
                med = self._fill_unknown(med)
            # padding T rows up to a larger bucket is always possible, so cost(T) is at most any
            # larger bucket's: the non-increasing-from-the-right envelope (keeps cost monotone)
            env = med
            for i in range(len(env) - 2, -1, -1):
                if env[i + 1] < env[i]:
                    env[i] = env[i + 1]
            self._envelope = env
        return self._envelope

    def _nearest_cached(self, flags: list[bool]) -> list[int | None]:
        """nearest_flagged, re-taken only when the flags change (a bucket's first real step)."""
        key = tuple(flags)
        if self._near_key != key:
            self._near_key, self._near = key, nearest_flagged(self.buckets, flags)
        return self._near

    def _fill_unknown(self, med: list[float | None]) -> list[float]:
        bs = self.buckets
        near = nearest_flagged(bs, [m is not None for m in med])
        out = []
        for i, m in enumerate(med):
            j = near[i]
            if m is not None:
                out.append(m)
            elif j is None:
                out.append(float(bs[i]))
            else:
                out.append(med[j] * bs[i] / bs[j])
        return out

    def observed(self, rows: int) -> bool:
        """Is f(rows) a median of real steps (not start-up values or an extrapolation)?"""
        return 0 < rows <= self.buckets[-1] and self._observed[self._bucket_at_or_above(rows)]

    def _bucket_at_or_above(self, rows: int) -> int:
        return min(bisect.bisect_left(self.buckets, rows), len(self.buckets) - 1)

    def points(self) -> list[tuple[int, float]]:
        return list(zip(self.buckets, self._curve()))

    # -- cache ----------------------------------------------------------------------------------
    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(
            json.dumps(
                {
                    "buckets": self.buckets,
                    "kv_cost": self.kv_cost,
                    "req_cost": self.req_cost,
                    "samples": [list(s) for s in self._samples],
                }
            )
        )

    @classmethod
    def load(cls, path: Path, buckets: list[int], padded: bool = False) -> StepCostCurve | None:
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        if data.get("buckets") != sorted(set(buckets)) or "req_cost" not in data:
            return None
        samples = data["samples"]
        if not all(math.isfinite(x) and x > 0 for s in samples for x in s):
            return None  # written before f was kept positive: recalibrate
        curve = cls(buckets, padded=padded, kv_cost=data["kv_cost"], req_cost=data["req_cost"])
        for dq, s in zip(curve._samples, samples):
            dq.extend(s)
        return curve
