"""The step-cost curves at start-up: synthetic steps measure the context term (kv_cost), the
per-request term (req_cost) and f over the row buckets the engine uses; the raw samples are
cached per model/device/dtype/threads/shape, so a restart skips the measurement.

Each curve is measured in the shape of the steps it prices. The synchronous curve prices
speculative steps, 1 + k rows per request; the plain curve prices decode steps, one row each.
Measured decode-shaped up to max_num_seqs rows (and verify-shaped only above), the synchronous
curve jumped 25 % from 256 to 272 rows on the H200 (8B, 256 requests): one request with two rows
switches attention to its verify path, which a step of 64 requests x 5 rows does not feel as
much. Real steps measured at 256 rows (verify-shaped: 15 % above the decode-shaped start-up)
then scaled the unmeasured 272-320 buckets up by the same 15 %, on top of the jump: at 64
requests x 4 drafts the chooser kept ~3 drafts per request where fixed k's 4 ran 7 % faster.
"""

from __future__ import annotations

import hashlib
import statistics
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from specserve.speculative.curve_math import theil_sen
from specserve.speculative.step_cost import StepCostCurve

if TYPE_CHECKING:
    from specserve.llm_engine import LLMEngine

CALIBRATION_CONTEXT = 128  # tokens of context per synthetic request
KV_CALIBRATION_CONTEXT = 640  # the longer context of the kv_cost measurement


class StartupCalibration:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine

    def cache_path(self, root: Path | None, buckets: list[int], shape: str) -> Path | None:
        if root is None:
            return None
        eng = self.engine
        dev = torch.cuda.get_device_name(eng.device) if eng.device.type == "cuda" else "cpu"
        key = f"{eng.model_name}|{dev}|{eng.dtype}|{torch.get_num_threads()}|{buckets}|{eng.config.block_size}|eager={eng.config.enforce_eager}|{shape}|k={eng.slot_pool.k}|tp={eng.config.tensor_parallel_size}"
        return root / "step-cost" / (hashlib.sha1(key.encode()).hexdigest()[:16] + ".json")

    def requests_for(self, rows: int, decode_shaped: bool) -> int:
        """The requests of a synthetic step of `rows` rows: one row each (decode-shaped) or
        1 + k each (verify-shaped, the last one fewer), up to max_num_seqs."""
        per = 1 if decode_shaped else 1 + self.engine.slot_pool.k
        return max(1, min(-(-rows // per), self.engine.config.max_num_seqs))

    def load_or_calibrate(
        self,
        buckets: list[int],
        root: Path | None,
        decode_shaped: bool = False,
        fixed: tuple[float, float] | None = None,
    ) -> StepCostCurve:
        """The curve over `buckets`, measured with verify-shaped steps (the synchronous curve) or
        decode-shaped ones (the plain curve). fixed: (kv_cost, req_cost) already measured."""
        path = self.cache_path(root, buckets, "decode" if decode_shaped else "verify")
        # decode/verify steps up to the largest bucket run padded to their bucket on CUDA
        padded = self.engine.runner.graphs is not None
        curve = StepCostCurve.load(path, buckets, padded) if path is not None else None
        if curve is None:
            if fixed is None:
                kv_cost = self._measure_kv_cost()
                fixed = (kv_cost, self._measure_req_cost(kv_cost))
            curve = StepCostCurve(buckets, padded=padded, kv_cost=fixed[0], req_cost=fixed[1])

            def f(rows: int) -> float:  # the step without its fixed terms
                n_req = self.requests_for(rows, decode_shaped)
                secs = self._synthetic_step(rows, n_req=n_req)
                return curve.rows_part(secs, n_req * CALIBRATION_CONTEXT, n_req)

            curve.calibrate(f, reps=2)
            if path is not None:
                curve.save(path)  # the raw samples: smoothing is a choice of this code
        if not padded:
            curve.smooth_to_line()
        return curve

    def _full_step_rows(self) -> int:
        """Rows of the fixed-cost measurements: as many one-row requests as a step holds."""
        eng = self.engine
        return max(1, min(eng.config.max_num_seqs, eng.max_num_batched_tokens))

    def _measure_kv_cost(self, reps: int = 3) -> float:
        """Seconds per context token a step's requests read: synthetic decode steps of the same
        rows (one per request, as many requests as a step holds) at three context lengths; the
        median slope over all pairs of samples at different lengths (Theil-Sen: one slow sample
        on a busy machine does not set it)."""
        eng = self.engine
        long_ctx = min(KV_CALIBRATION_CONTEXT, eng.max_model_len - 2)
        if long_ctx <= CALIBRATION_CONTEXT:
            return 0.0
        rows = self._full_step_rows()
        ctxs: list[int] = []
        times: list[float] = []
        for ctx in (CALIBRATION_CONTEXT, (CALIBRATION_CONTEXT + long_ctx) // 2, long_ctx):
            self._synthetic_step(rows, ctx)  # warm-up: buffers for this context
            for _ in range(reps):
                ctxs.append(ctx)
                times.append(self._synthetic_step(rows, ctx))
        slope, _ = theil_sen(ctxs, times)  # seconds per context token of every request
        return max(0.0, slope / rows)

    def _measure_req_cost(self, kv_cost: float, reps: int = 3) -> float:
        """Seconds per request in a step beyond its rows and context: synthetic steps of the same
        rows, decode-shaped (one row per request) and verify-shaped (1 + k rows per request),
        their context terms taken out."""
        eng = self.engine
        per = 1 + eng.slot_pool.k
        rows = self._full_step_rows()
        few = -(-rows // per)
        if few >= rows:
            return 0.0
        times = []
        for n_req in (rows, few):
            self._synthetic_step(rows, n_req=n_req)  # warm-up
            t = statistics.median(self._synthetic_step(rows, n_req=n_req) for _ in range(reps))
            times.append(t - kv_cost * n_req * CALIBRATION_CONTEXT)  # context term out
        return max(0.0, (times[0] - times[1]) / (rows - few))

    def _synthetic_step(
        self, rows: int, context: int = CALIBRATION_CONTEXT, n_req: int | None = None
    ) -> float:
        """One forward + logits of `rows` decode/verify rows of `n_req` requests (default: one
        per row, up to max_num_seqs), each request over `context` tokens. The KV blocks are the
        free ones, distinct per request as far as they go (start-up: no request holds any, and a
        request writes every position before reading it), so the reads cost what real ones do
        rather than hitting one cached block."""
        eng = self.engine
        n_req = n_req or max(1, min(rows, eng.config.max_num_seqs))
        per = [rows // n_req + (1 if i < rows % n_req else 0) for i in range(n_req)]
        nb = (context + max(per)) // eng.config.block_size + 1
        usable = max(1, eng.num_kv_blocks - 1)  # block 0 is the padding block
        tables = [[1 + (r * nb + j) % usable for j in range(nb)] for r in range(n_req)]
        inputs = eng.runner.prepare_rows([[1] * q for q in per], [context] * n_req, tables, per)
        _sync(eng.device)
        t0 = time.perf_counter()
        logits = eng.runner.forward(inputs)
        logits.argmax(-1).tolist()  # the step's one host sync, as in a real step
        return time.perf_counter() - t0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
