"""The step-cost curve: seconds of one decode/verify step against its total rows (total_q).

Per graph bucket: a start-up sweep's price (cached per machine and model under
$SPECSERVE_CACHE/step-cost), then the median of its last WINDOW real steps, each divided by the
machine's speed when it ran; a monotone envelope over the buckets. Optimistic on purpose: a price
too low is chosen, run and corrected. docs/verify_budget.md has the why.
"""

from __future__ import annotations

import hashlib
import json
import statistics
import time
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from specserve import env

if TYPE_CHECKING:
    from specserve.llm_engine import LLMEngine

WINDOW = 16  # real steps per bucket in its median: recent enough to follow the machine
SWEEP_REPS = 3  # start-up steps per bucket (their median), after one warm-up
SWEEP_CONTEXT = 128  # context tokens per synthetic request


class StepCostCurve:
    def __init__(self, buckets: list[int], startup: list[float], padded: bool) -> None:
        assert buckets == sorted(set(buckets)) and len(startup) == len(buckets)
        self.buckets = np.asarray(buckets, dtype=np.int64)
        self.padded = padded
        self._value = np.asarray(startup, dtype=np.float64)  # per bucket: real median, or start-up
        self._real: list[deque[float]] = [deque(maxlen=WINDOW) for _ in buckets]
        self._warm = np.zeros(len(buckets), dtype=bool)  # its warm-up step has been left out
        self._env: np.ndarray | None = None
        # the machine's speed: median seconds / reference over recent steps of priced buckets
        # (real steps are kept divided by it); a bucket's reference is its first real price,
        # frozen: its current price would feed the speed back into itself (a random walk)
        self._ratios: deque[float] = deque(maxlen=WINDOW)
        self._ref = np.zeros(len(buckets))  # 0: not priced yet
        self.speed = 1.0

    def observe(self, rows: int, seconds: float) -> None:
        """A real decode/verify step of `rows` total rows took `seconds`."""
        if rows <= 0 or seconds <= 0 or rows > self.buckets[-1]:
            return  # past the largest bucket: extrapolated, never folded into it
        i = int(np.searchsorted(self.buckets, rows))  # the bucket at or above rows
        b = int(self.buckets[i])
        if not self.padded and rows != b:
            seconds *= self(b) / self(rows)  # unpadded: scaled to its bucket by the curve's shape
        if not self._warm[i]:
            self._warm[i] = True
            return
        if self._ref[i] > 0:
            self._ratios.append(seconds / self._ref[i])
            if len(self._ratios) >= SWEEP_REPS:  # one stalled step never sets the speed
                self.speed = statistics.median(self._ratios)
        self._real[i].append(seconds / self.speed)
        if len(self._real[i]) >= SWEEP_REPS:
            self._value[i] = statistics.median(self._real[i])
            self._ref[i] = self._ref[i] or self._value[i]
            self._env = None

    def observed(self, rows: int) -> bool:
        return len(self._real[int(np.searchsorted(self.buckets, rows))]) >= SWEEP_REPS

    def envelope(self) -> np.ndarray:
        """[buckets] the monotone per-bucket prices."""
        if self._env is None:
            seen = np.array([len(r) >= SWEEP_REPS for r in self._real])
            # an unmeasured bucket costs at least every measured smaller one: one never
            # reached would otherwise cap every bucket below it at its start-up price
            floor = np.maximum.accumulate(np.where(seen, self._value, 0.0))
            v = np.where(seen, self._value, np.maximum(self._value, floor))
            self._env = np.minimum.accumulate(v[::-1])[::-1].copy()
        return self._env

    def times(self, rows: np.ndarray) -> np.ndarray:
        """Seconds of a step of each number of total rows (int array), at the current speed."""
        env, bs = self.envelope() * self.speed, self.buckets
        r = np.asarray(rows, dtype=np.float64)
        if self.padded:
            out = env[np.minimum(np.searchsorted(bs, rows), len(bs) - 1)]
        else:
            out = np.interp(r, bs, env)  # flat below the smallest bucket
        return np.where(r > bs[-1], env[-1] * r / bs[-1], out)

    def __call__(self, rows: int) -> float:
        return float(self.times(np.asarray([rows]))[0])

    def points(self) -> list[tuple[int, float]]:
        """(bucket, price) pairs: the curve as the chooser sees it."""
        return [(int(b), float(t) * self.speed) for b, t in zip(self.buckets, self.envelope())]


def startup_curve(engine: LLMEngine, buckets: list[int], cache_root: Path | None) -> StepCostCurve:
    """The curve from the start-up sweep over `buckets` (measured, or read from the cache)."""
    padded = engine.runner.graphs is not None  # steps up to the largest bucket run padded
    path = _cache_path(engine, buckets, cache_root)
    try:
        startup = json.loads(path.read_text()) if path is not None else None
    except (OSError, ValueError):  # none yet, or unreadable: measured again
        startup = None
    if not isinstance(startup, list) or len(startup) != len(buckets):
        startup = []
        for b in buckets:
            _synthetic_step(engine, b)  # warm-up: first touch of buffers and kernels
            startup.append(statistics.median(_synthetic_step(engine, b) for _ in range(SWEEP_REPS)))
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(startup))
    return StepCostCurve(buckets, [max(float(t), 1e-9) for t in startup], padded)


def _cache_path(engine: LLMEngine, buckets: list[int], root: Path | None) -> Path | None:
    if root is None:
        return None
    e, c, s = engine, engine.config, env.settings
    dev = torch.cuda.get_device_name(e.device) if e.device.type == "cuda" else "cpu"
    head = getattr(e.target_model, "lm_head", None)
    key = repr((e.model_name, dev, e.dtype, e.kv_dtype, torch.get_num_threads(), buckets))
    key += repr((c.block_size, c.enforce_eager, e.slot_pool.k, SWEEP_REPS, c.tensor_parallel_size))
    key += repr((s.cpu_linear, s.fused_ops, s.cpu_layer, s.cpu_amx, head and head.extra_repr()))
    return root / "step-cost" / (hashlib.sha1(key.encode()).hexdigest()[:16] + ".json")


def _synthetic_step(engine: LLMEngine, rows: int) -> float:
    """Seconds of one forward + logits of `rows` rows laid out as the cheapest verify step of
    that many (the fewest requests, 1 + k rows each, SWEEP_CONTEXT tokens in KV blocks of their
    own): optimistic, as real steps with more requests only cost more."""
    eng = engine
    n_req = max(1, min(-(-rows // (1 + eng.slot_pool.k)), eng.config.max_num_seqs))
    per = [rows // n_req + (1 if i < rows % n_req else 0) for i in range(n_req)]
    nb = (SWEEP_CONTEXT + max(per)) // eng.config.block_size + 1
    usable = max(1, eng.num_kv_blocks - 1)  # block 0 is the padding block
    tables = [[1 + (r * nb + j) % usable for j in range(nb)] for r in range(n_req)]
    inputs = eng.runner.prepare_rows([[1] * q for q in per], [SWEEP_CONTEXT] * n_req, tables, per)
    if eng.device.type == "cuda":
        torch.cuda.synchronize(eng.device)
    t0 = time.perf_counter()
    eng.runner.forward(inputs).argmax(-1).tolist()  # the step's one host sync, as in a real step
    return time.perf_counter() - t0
