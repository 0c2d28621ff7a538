"""The engine: one step = schedule -> forward -> verify -> process_outputs (the ledger)."""

from __future__ import annotations

import logging
import random
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from specserve import env
from specserve.config import EngineConfig
from specserve.distributed import TensorParallelError, start_tensor_parallel
from specserve.engine.admission import admit
from specserve.engine.block_manager import BlockManager
from specserve.engine.device import (
    freeze_startup_objects,
    release_dropped_engines,
    resolve_device,
    resolve_dtype,
)
from specserve.engine.draft_rows import draft_rows
from specserve.engine.isolation import FaultIsolation
from specserve.engine.launch import LaunchedStep, Launcher, settle
from specserve.engine.ledger import HostStepResult, Ledger
from specserve.engine.outputs import OutputPool, TokenOutput
from specserve.engine.scheduler import Scheduler, StepBatch
from specserve.engine.sequence import FinishReason, Sequence
from specserve.engine.slots import DraftSlotPool
from specserve.model.cpu_linear import pack_linears
from specserve.model.loader import cache_dir, load_model
from specserve.ops.triton_attention import use_triton
from specserve.runner.cuda_graph import CudaGraphBackend
from specserve.runner.model_runner import ModelRunner, kv_bytes_per_block
from specserve.runner.step_sampler import StepSampler
from specserve.runner.timeline import StepTimeline
from specserve.sampling_params import SamplingParams
from specserve.speculative.device_drafting import DEVICE_METHODS, DeviceDrafting
from specserve.speculative.drafter import build_drafter
from specserve.speculative.speculator import Speculator
from specserve.speculative.verify_budget import VerifyBudget
from specserve.structured.backend import GrammarBackend

log = logging.getLogger("specserve.engine")
_FAILED = object()  # _read_or_roll_back: the step failed and was rolled back


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_usage: float
    num_free_blocks: int
    num_blocks: int
    pool_free: int
    pool_capacity: int


class LLMEngine:
    def __init__(self, config: EngineConfig, progress: bool = True) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        release_dropped_engines(self.device)  # an engine built before, now dropped, goes first
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.kv_dtype = self.dtype if config.kv_cache_dtype == "auto" else torch.bfloat16
        # tensor parallelism: workers start now; the model loads on the host, then is sharded
        self.tp = start_tensor_parallel(config, self.device)
        device = self.tp.load_device if self.tp else self.device
        loaded = load_model(
            config.model, self.dtype, device, progress, config.tokenizer, config.revision
        )
        if self.tp:
            loaded.model = self.tp.shard(loaded.model, loaded.config, self.dtype)
        elif config.quantization is None:  # quantize_engine swaps the dense layers later
            pack_linears(loaded.model)  # CPU: oneDNN over packed weights (a no-op elsewhere)
        self.model_name = loaded.name
        self.model_config = mc = loaded.config
        self.tokenizer = loaded.tokenizer
        self.max_model_len = min(
            config.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings
        )
        k = config.speculative_config.num_speculative_tokens if config.speculative_config else 0
        self.max_num_batched_tokens = config.step_token_budget(self.device.type, self.max_model_len)
        if self.max_num_batched_tokens < config.max_num_seqs * (1 + k):
            self.max_num_batched_tokens = config.max_num_seqs * (1 + k)
        num_blocks = self._num_kv_blocks()
        self.num_kv_blocks = num_blocks
        self.target_model = loaded.model
        spec = config.speculative_config
        want = config.overlap if config.overlap is not None else self.device.type == "cuda"
        # Device drafters (n-gram, golden) draft inside the step, so overlap holds with
        # speculation on; they run with overlap (on CPU too, with the forward in the worker).
        # Host drafters (draft model, EAGLE-3) need each step's tokens on the host before they
        # draft the next: with them only the steps that verify no drafts overlap (the verify
        # budget pausing speculation at high load, or nothing to draft: Speculator.may_overlap).
        # (not under tensor parallelism: workers rebuild each step's inputs from its rows and
        # have no slot pool to read drafts from; drafters there run on rank 0's host)
        on_device = (
            spec is not None
            and want
            and spec.method in DEVICE_METHODS
            and env.settings.device_drafts
            and self.tp is None
        )
        self.drafter = build_drafter(spec, self) if spec and not on_device else None
        self.overlap = want and self.drafter is None
        self.overlap_when_paused = want and self.drafter is not None
        # one slot per running request: drafts live there, and so does the token each request
        # sampled last (runner.next_tokens), which overlap feeds to the next step on the device
        self.slot_pool = (
            DraftSlotPool(
                config.max_num_seqs,
                k,
                mc.vocab_size,
                (self.drafter is not None and self.drafter.has_q)
                or (on_device and spec.method in ("eagle3", "draft_model")),
                self.device,
            )
            if spec or want
            else None
        )
        self.device_drafting = (
            DeviceDrafting(
                spec, self.slot_pool, mc.vocab_size, config.seed, self.max_model_len, self
            )
            if on_device
            else None
        )
        runner_args = (
            loaded.model,
            mc.num_hidden_layers,
            mc.num_key_value_heads,
            mc.head_dim,
            num_blocks,
            config.block_size,
            self.dtype,
            self.device,
            config.max_num_seqs,
        )
        if self.tp:
            self.runner = self.tp.runner(*runner_args)
        else:
            pool = self.slot_pool
            self.runner = ModelRunner(
                *runner_args,
                pool.draft_ids if pool is not None else None,
                pool.rejected if pool is not None else None,
                self.kv_dtype,
            )
        # Before the verify budget's calibration below, so the step-cost curve times the graphs.
        self.runner.init_cuda_graphs(
            config.max_num_seqs,
            1 + k,
            self.max_model_len,
            capture=not config.enforce_eager,
            progress=progress,
        )
        if (
            self.device_drafting
            and getattr(self.runner, "graphs", None)
            and not config.enforce_eager
        ):
            self.device_drafting.capture(CudaGraphBackend(self.device))
        if use_triton(self.device):
            self.runner.warm_up_eager(min(self.max_num_batched_tokens, self.max_model_len))
        eos = frozenset(
            mc.eos_token_ids or ([self.tokenizer.eos_token_id] if self.tokenizer else [])
        )
        self.eos_ids = eos
        self.block_manager = BlockManager(
            num_blocks, config.block_size, config.enable_prefix_caching
        )
        self.scheduler = Scheduler(
            self.block_manager,
            config.max_num_seqs,
            self.max_num_batched_tokens,
            self.max_model_len,
            self.slot_pool,
            device_drafts=self.device_drafting is not None,
            # a model drafter's chain writes its own KV k - 1 positions past the verified rows
            lookahead=k - 1 if self.device_drafting and self.device_drafting.model_drafter else 0,
        )
        # two steps of outputs live at once, each at most every row of a step plus the requests
        # that end without a token in it (aborts, prompt too long)
        cap = config.output_pool_capacity or 2 * (
            self.max_num_batched_tokens + 4 * config.max_num_seqs
        )
        self.pool = OutputPool(cap)
        self.ledger = Ledger(self.scheduler, self.pool, eos, self.tokenizer)
        self.sampler = StepSampler(self.device, eos, mc.vocab_size, self.slot_pool)
        self.launcher = Launcher(self)  # queues each step's device work (engine/launch.py)
        # structured outputs: xgrammar is set up at the first request that needs it
        self.grammars = GrammarBackend(self.tokenizer, self.model_config.vocab_size, eos)
        self.requests: dict[str, Sequence] = {}
        self._terminal: list[Sequence] = []  # ended without a token; reported next step
        self.seed_rng = random.Random(config.seed)  # seeds of requests that set none
        self._next_id = 0
        self.num_steps = 0
        self.num_sync_steps = 0  # launched synchronously (host drafts, or overlap off)
        # launched behind the step in flight with their sampling queued after its ledger (a
        # request reads its output tokens on the host: launch.py)
        self.num_deferred_steps = 0
        # steps with prompt rows: eager on CUDA (the graphs take decode/verify steps only)
        self.num_prompt_steps = 0
        self._inflight: LaunchedStep | None = None  # overlap: launched, not yet through the ledger
        self._isolation: FaultIsolation | None = None  # a failed step's requests being searched
        # CPU ops are synchronous: overlap there needs the forward in a thread of its own (one,
        # so steps still run in order and each reads the next_tokens its predecessor wrote)
        self._worker = (
            ThreadPoolExecutor(
                1,
                thread_name_prefix="specserve-step",
                # intra-op thread counts are per thread under OpenMP: match the caller's, or the
                # GEMMs block differently and greedy outputs drift from the synchronous path
                initializer=torch.set_num_threads,
                initargs=(torch.get_num_threads(),),
            )
            if want and self.device.type != "cuda"
            else None
        )
        self.timeline = StepTimeline(self.device)  # device idle between steps (benchmarks)
        self.budget = (
            VerifyBudget.for_engine(self, cache_dir() if config.cache_step_cost else None)
            if (self.drafter is not None or on_device) and spec.verify_budget == "auto"
            else None
        )
        self.speculator = Speculator(self) if self.drafter is not None else None
        self._last_readback: float | None = None  # of the last step read back (_time_step)
        if self.device.type == "cuda":
            freeze_startup_objects()

    def _num_kv_blocks(self) -> int:
        mc, cfg = self.model_config, self.config
        kv_heads = self.tp.plan.max_kv_heads if self.tp else mc.num_key_value_heads  # per rank
        per_block = kv_bytes_per_block(
            mc.num_hidden_layers, kv_heads, mc.head_dim, cfg.block_size, self.kv_dtype
        )
        if cfg.kv_cache_memory_gb is not None:
            budget = int(cfg.kv_cache_memory_gb * 2**30)
        elif self.device.type == "cuda":
            free, _total = torch.cuda.mem_get_info(self.device)
            budget = cfg.cuda_kv_budget(free, _total)  # gpu_memory_utilization's share
        else:
            budget = 2 * 2**30
        useful = (
            cfg.max_num_seqs * ((self.max_model_len + cfg.block_size - 1) // cfg.block_size + 1) + 1
        )
        return max(2, min(budget // per_block, useful))

    # -- requests ---------------------------------------------------------------------------
    def new_request_id(self) -> str:
        self._next_id += 1
        return str(self._next_id)

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        arrival_time: float | None = None,
        *,
        defer_text: bool = False,
    ) -> Sequence:
        """Validate and queue (admission.py): a user error raises InvalidRequestError before
        anything is queued, so no other request is touched. defer_text:
        the caller reads the text at the end only (its outputs' text is "" until the last,
        which carries all of it): without stop strings it is decoded once, not per token."""
        seq = admit(self, prompt, params, request_id, arrival_time, defer_text)
        self.requests[seq.request_id] = seq
        self.scheduler.add(seq)
        if seq.is_finished:  # prompt too long: finish_reason prompt_length_exceeded
            self._terminal.append(seq)
        return seq

    def abort(self, request_id: str) -> bool:
        seq = self.requests.get(request_id)
        if seq is None or seq.is_finished:
            return False
        self.scheduler.finish(seq, FinishReason.ABORT)
        self._terminal.append(seq)
        return True

    def forget(self, request_id: str) -> Sequence | None:
        """Drop a finished request whose final output has been handed out."""
        seq = self.requests.pop(request_id, None)
        if seq is not None:
            if self.speculator is not None:
                self.speculator.release(seq)
            if self.device_drafting is not None:
                self.device_drafting.release(seq)
        return seq

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def fail_all(self, reason: FinishReason = FinishReason.ABORT) -> list[Sequence]:
        """After an internal error: end every unfinished request (blocks, slots freed) so the
        engine is clean again. Returns them; their terminal outputs come with the next step."""
        failed = [s for s in self.requests.values() if not s.is_finished]
        self._inflight = None  # its requests are all aborted below: nothing to read back
        self._isolation = None
        for seq in failed:
            self.abort(seq.request_id)
        return failed

    # -- one step ---------------------------------------------------------------------------
    def step(self) -> list[TokenOutput]:
        """Synchronous: schedule, launch and process step N. Overlap: schedule and launch step
        N+1, then process step N (still running on the device until its readback arrives, while
        N+1 queues behind it), so the ledger is one step late; a step with no rows flushes. A
        step N+1 whose sampling reads step N's tokens on the host (grammars, penalties, bad
        words) queues its forward first and its sampling after N's ledger (launch.py).

        A step that fails before the ledger is rolled back and its requests searched for the
        ones whose inputs caused it (isolation.py): only those end, with finish_reason "error";
        the others continue as if nothing had happened. Raises isolation.EngineStepError when
        no request's inputs explain a failure."""
        outputs = self._isolation_step() if self._isolation is not None else None
        if outputs is None:
            outputs = self._step()
        for out in outputs:
            if out.finished:
                self.forget(out.request_id)
        if not self.requests:
            self._last_readback = None  # idle until the next request: no step's period
        if self.config.debug_invariants:
            self.check_invariants()
        return outputs

    def _step(self) -> list[TokenOutput]:
        outputs: list[TokenOutput] = []
        overlap = self._overlap_now()
        if self._inflight is not None and not overlap:
            # taken before processing: a step whose readback raised is not processed again
            inflight, self._inflight = self._inflight, None
            host = self._read_or_roll_back(inflight)
            if host is _FAILED:
                return outputs
            outputs += self._commit(inflight, host, self.scheduler.step_id + 1, draft=True)
            if self.overlap_when_paused and self.speculator is not None:
                # the drafting just done decides: drafts kept need the synchronous path; none
                # (the budget kept none, or nothing to draft) lets this step run overlapped
                overlap = not self.speculator.has_drafts()
        batch = self.scheduler.schedule(draft_caps=self._draft_caps())
        self.pool.release_through(batch.step - 2)
        outputs += self._take_terminal(batch.step)
        launched = None
        if not batch.is_empty:
            self.num_steps += 1
            self.num_sync_steps += not overlap
            try:
                launched = self._launch(batch, overlap)
            except Exception as e:
                # nothing of it reached the ledger; a step in flight is older and independent
                # of it, so it is still processed below
                self.scheduler.roll_back(batch, undo_pending=False)
                self._isolate(batch.seqs, e)
        if not overlap:
            if launched is not None:
                host = self._read_or_roll_back(launched)
                if host is not _FAILED:
                    outputs += self._commit(launched, host, batch.step, draft=True)
        else:
            inflight, self._inflight = self._inflight, launched
            if inflight is not None:
                outputs += self._process_in_flight(inflight, launched, batch.step)
            if self._inflight is not None and self._inflight.deferred is not None:
                self._finish_deferred(self._inflight)  # planned from the tokens just committed
            # the text of the step just committed, now that the next one's device work is all
            # queued (a deferred step's sampling waited for the ledger, not for this)
            self.ledger.fill_text(outputs)
        return outputs

    def _draft_caps(self) -> dict[int, int] | None:
        """Device drafters with the verify budget: each decode-ready request's draft rows in
        the next step, by slot (None: k each)."""
        dd, sched = self.device_drafting, self.scheduler
        if dd is None or self.budget is None:
            return None
        ready = sched.decode_ready()
        k, limit = self.slot_pool.k, self.max_num_batched_tokens
        room = [draft_rows(s, k, limit, self.max_model_len) for s in ready]
        return {s.slot: m for s, m in zip(ready, dd.allot(ready, self.budget, room))}

    def _process_in_flight(
        self, inflight: LaunchedStep, newer: LaunchedStep | None, out_step: int
    ) -> list[TokenOutput]:
        """Read back and commit the step in flight, `newer` launched behind it."""
        host = self._read_or_roll_back(inflight, newer=newer)
        if host is _FAILED:
            self._inflight = None  # rolled back with it: it read the failed step's tokens
            return []
        try:
            return self._commit(inflight, host, out_step, draft=False, defer_text=True)
        except BaseException:
            if newer is not None and newer.deferred is not None:
                # a ledger that failed midway plans no sampling: the step is undone
                self._inflight = None
                settle(newer)
                self.scheduler.roll_back(newer.batch, undo_pending=False)
            raise

    def _finish_deferred(self, launched: LaunchedStep) -> None:
        """Queue a deferred step's sampling. Planning it fails like launching a step does (a
        grammar whose mask the request's other bans empty): rolled back, its requests searched."""
        try:
            self.launcher.finish(launched)
        except Exception as e:
            self._inflight = None
            settle(launched)
            self.scheduler.roll_back(launched.batch, undo_pending=False)
            self._isolate(launched.batch.seqs, e)

    def _take_terminal(self, step: int) -> list[TokenOutput]:
        """The outputs of requests that ended without a token (aborted, refused, failed)."""
        outputs = []
        while self._terminal and self.pool.num_free > self.max_num_batched_tokens:
            outputs.append(self.ledger.terminal_output(self._terminal.pop(0), step))
        return outputs

    # -- fault isolation (isolation.py) -----------------------------------------------------
    def _isolate(self, seqs: list[Sequence], exc: BaseException) -> None:
        if isinstance(exc, TensorParallelError):
            raise exc  # a worker is gone: no request is to blame, the engine ends
        log.warning(
            "a step of %d requests failed (%s: %s); searching for the requests that caused it",
            len(seqs),
            type(exc).__name__,
            exc,
            exc_info=exc,
        )
        if self._isolation is None:
            self._isolation = FaultIsolation.start(list(seqs))
        else:
            self._isolation.add(list(seqs))

    def _read_or_roll_back(
        self, launched: LaunchedStep, newer: LaunchedStep | None = None
    ) -> HostStepResult | None | object:
        """_read(), or on failure: roll the step back (and `newer`, launched behind it and fed
        its tokens on the device), start the search over its requests, return _FAILED."""
        try:
            return self._read(launched)
        except Exception as e:
            if newer is not None:
                settle(newer)
                self.scheduler.roll_back(newer.batch, undo_pending=newer.overlapped)
            self.scheduler.roll_back(launched.batch, undo_pending=launched.overlapped)
            self._isolate(launched.batch.seqs, e)
            return _FAILED

    def _isolation_step(self) -> list[TokenOutput] | None:
        """One step of the search: the next group alone, synchronously. None when the search
        is over (its culprits are ended; the caller runs a normal step)."""
        iso = self._isolation
        assert iso is not None and self._inflight is None
        group = iso.next_group()
        if group is None:
            self._end_isolation()
            return None
        batch = self.scheduler.schedule(only={s.request_id for s in group})
        self.pool.release_through(batch.step - 2)
        if batch.is_empty:
            # the group cannot run alone now (requests outside it hold the KV or the places it
            # needs): end the search; it runs with the others again, and a new search starts if
            # it fails. Ended before the terminal outputs are taken: if it raises, none is lost
            self._end_isolation()
            return self._take_terminal(batch.step)
        outputs = self._take_terminal(batch.step)
        self.num_steps += 1
        self.num_sync_steps += 1
        try:
            launched = self._launch(batch, overlap=False)
            host = self._read(launched)
        except Exception as e:
            self.scheduler.roll_back(batch, undo_pending=False)
            iso.step_failed(group, batch.seqs, e)
            return outputs
        outputs += self._commit(launched, host, batch.step, draft=True)
        iso.step_passed(group, [s for s, sm in zip(batch.seqs, batch.samples) if sm])
        return outputs

    def _end_isolation(self) -> None:
        iso, self._isolation = self._isolation, None
        for seq, exc in iso.verdict():
            self.ledger.fail(seq, exc)
            self._terminal.append(seq)

    def _overlap_now(self) -> bool:
        if self.overlap:
            return True
        return self.speculator is not None and self.speculator.may_overlap(
            in_flight=self._inflight is not None
        )

    def _launch(self, batch: StepBatch, overlap: bool) -> LaunchedStep:
        """Queue the step's device work (launch.py); nothing waits for it."""
        launched = self.launcher.launch(batch, overlap, behind=self._inflight is not None)
        self.num_deferred_steps += launched.deferred is not None
        self.num_prompt_steps += not batch.is_decode_shaped
        return launched

    def _read(self, launched: LaunchedStep) -> HostStepResult | None:
        """Wait for a launched step's results (the designed sync point); the drafter learns
        from them. Everything before the ledger: a failure here leaves no trace once the step
        is rolled back."""
        batch, seqs = launched.batch, launched.seqs
        assert launched.deferred is None, "a deferred step's sampling was never queued"
        host = launched.sampled.wait() if launched.sampled is not None else None
        if self.tp:
            self.tp.check_alive()  # a step a worker died in is not trusted (CUDA: aborted NCCL)
        if self.budget is not None:
            self._time_step(launched)
        if self.speculator is not None and host is not None:
            host = self.speculator.observe(batch, seqs, host)
        if self.device_drafting is not None and host is not None:
            self.device_drafting.observe(seqs, host)
        return host

    def _time_step(self, launched: LaunchedStep) -> None:
        """The verify budget's curve learns what a decode/verify step costs the run: the time
        between its readback and the previous one, i.e. its device time plus the host work of a
        step that overlap does not hide (ledger, drafting, scheduling). The first step after
        the engine was idle has no such period: its launch-to-readback. Prompt chunks cost far
        less per row: left out."""
        now = time.perf_counter()
        last, self._last_readback = self._last_readback, now
        if launched.batch.is_decode_shaped:
            start = last if last is not None else launched.t0
            self.budget.observe_step(launched.batch.num_rows, now - start)

    def _commit(
        self,
        launched: LaunchedStep,
        host: HostStepResult | None,
        out_step: int,
        draft: bool,
        defer_text: bool = False,
    ) -> list[TokenOutput]:
        """Run the ledger and, with a drafter and draft=True (the next step is synchronous),
        draft the next step. Outputs belong to out_step for the pool; defer_text: their text
        waits for ledger.fill_text()."""
        outputs = self.ledger.process_outputs(launched.batch, host, out_step, defer_text)
        if self.speculator is not None and draft:
            try:
                self.speculator.propose()
            except Exception:
                # drafts never change what is emitted (verification is lossless): the next
                # step runs without them rather than fail anyone
                log.exception("drafting failed; the next step runs without drafts")
                for s in self.scheduler.running:
                    self.slot_pool.clear(s.slot)
        return outputs

    def release_outputs(self) -> None:
        """The caller has consumed every output handed out so far (e.g. the engine went idle):
        return them all to the pool."""
        self.pool.release_through(self.scheduler.step_id)

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers (no-op without); the engine cannot step after."""
        if self.tp:
            self.tp.shutdown()

    def check_invariants(self) -> None:
        self.scheduler.check_invariants()
        if not self.requests:
            assert self.block_manager.num_used_blocks == 0

    def stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(
            len(self.scheduler.running),
            len(self.scheduler.waiting),
            bm.usage(),
            bm.num_free_blocks,
            bm.num_usable_blocks,
            self.pool.num_free,
            self.pool.capacity,
        )
