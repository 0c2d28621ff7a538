"""The engine: one step = schedule -> forward -> verify -> process_outputs (the ledger)."""

from __future__ import annotations

import gc
import random
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import NamedTuple

import torch

from specserve.config import EngineConfig
from specserve.engine.block_manager import BlockManager
from specserve.engine.detokenizer import IncrementalDetokenizer
from specserve.engine.device import resolve_device, resolve_dtype
from specserve.engine.ledger import HostStepResult, Ledger
from specserve.engine.outputs import OutputPool, TokenOutput
from specserve.engine.scheduler import Scheduler, StepBatch
from specserve.engine.sequence import FinishReason, Sequence
from specserve.model.loader import cache_dir, load_model
from specserve.ops.triton_attention import use_triton
from specserve.runner.model_runner import ModelRunner, kv_bytes_per_block
from specserve.runner.step_sampler import SampledStep, StepSampler
from specserve.runner.timeline import StepTimeline
from specserve.sampling_params import InvalidRequestError, SamplingParams
from specserve.spec.budget_policy import VerifyBudgetPolicy
from specserve.spec.drafter import build_drafter
from specserve.spec.slots import DraftSlotPool
from specserve.spec.speculator import Speculator
from specserve.spec.step_timer import StepTimer


class _WorkerStep:
    """A step whose device part runs in the CPU worker thread: waits for it, then for its
    results (None for a step of prefill chunks only)."""

    def __init__(self, future: Future) -> None:
        self.future = future

    def wait(self) -> HostStepResult | None:
        sampled = self.future.result()
        return sampled.wait() if sampled is not None else None


class LaunchedStep(NamedTuple):
    batch: StepBatch
    seqs: list[Sequence]  # its sampling requests, in verify-layout order
    sampled: SampledStep | _WorkerStep | None  # None: a step of prefill chunks only
    t0: float  # host time at launch (the step-cost curve)
    overlapped: bool  # processed at the next step() (its ledger one step late)
    behind: bool  # launched while its predecessor was still in flight (device queue never empty)


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
        self.dtype = resolve_dtype(config.dtype, self.device)
        loaded = load_model(
            config.model, self.dtype, self.device, progress, config.tokenizer, config.revision
        )
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
        self.drafter = build_drafter(spec, self) if spec else None
        # Overlap needs each step's tokens only on the device; a host-side drafter needs them on
        # the host before it can draft the next step. So with a drafter only the steps that
        # verify drafts run synchronously; the others overlap (speculation paused by the verify
        # budget at high load, or nothing to draft: Speculator.may_overlap).
        want = config.overlap if config.overlap is not None else self.device.type == "cuda"
        self.overlap = want and self.drafter is None
        self.overlap_when_paused = want and self.drafter is not None
        # one slot per running request: drafts live there, and so does the token each request
        # sampled last (runner.next_tokens), which overlap feeds to the next step on the device
        self.slot_pool = (
            DraftSlotPool(
                config.max_num_seqs,
                k,
                mc.vocab_size,
                self.drafter is not None and self.drafter.has_q,
                self.device,
            )
            if spec or want
            else None
        )
        self.runner = ModelRunner(
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
        # Before the verify budget's calibration below, so the step-cost curve times the graphs.
        self.runner.init_cuda_graphs(
            config.max_num_seqs,
            1 + k,
            self.max_model_len,
            capture=not config.enforce_eager,
            progress=progress,
        )
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
        )
        # two steps of outputs live at once, each at most every row of a step plus the requests
        # that end without a token in it (aborts, prompt too long)
        cap = config.output_pool_capacity or 2 * (
            self.max_num_batched_tokens + 4 * config.max_num_seqs
        )
        self.pool = OutputPool(cap)
        self.ledger = Ledger(self.scheduler, self.pool, eos, self.tokenizer)
        self.sampler = StepSampler(self.device, eos)
        self.requests: dict[str, Sequence] = {}
        self._terminal: list[Sequence] = []  # ended without a token; reported next step
        self._rng = random.Random(config.seed)
        self._next_id = 0
        self.num_steps = 0
        self.num_sync_steps = 0  # launched synchronously (drafts, penalties, or overlap off)
        self._inflight: LaunchedStep | None = None  # overlap: launched, not yet through the ledger
        # live requests whose sampler reads every output token on the host (penalties, bad
        # words): they force synchronous steps
        self._num_penalized = 0
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
            VerifyBudgetPolicy(self, cache_dir() if config.cache_step_cost else None)
            if spec is not None and spec.verify_budget == "auto"
            else None
        )
        self.speculator = Speculator(self) if self.drafter is not None else None
        self.step_timer = StepTimer(self.budget) if self.budget is not None else None
        if self.device.type == "cuda":
            # What start-up built (model, tokenizer vocab, graphs) lives as long as the engine:
            # out of the collector's sight, a full collection mid-run walks only the requests'
            # objects (a ~0.3 s host stall in a step of the 256-request H200 run looked like one)
            gc.collect()
            gc.freeze()

    def _num_kv_blocks(self) -> int:
        mc, cfg = self.model_config, self.config
        per_block = kv_bytes_per_block(
            mc.num_hidden_layers, mc.num_key_value_heads, mc.head_dim, cfg.block_size, self.dtype
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
    ) -> Sequence:
        """Validate and queue. A user error raises InvalidRequestError before anything is queued,
        so no other request is touched."""
        params = params or SamplingParams()
        params.validate()
        params.resolve_bad_words(self.tokenizer, self.model_config.vocab_size)
        if isinstance(prompt, str):
            if prompt == "":
                raise InvalidRequestError("prompt must not be empty", "prompt")
            text: str | None = prompt
            ids = self.tokenizer.encode(prompt)
        else:
            text, ids = None, [int(x) for x in prompt]
        if not ids:
            raise InvalidRequestError("prompt must contain at least one token", "prompt")
        vocab = self.model_config.vocab_size
        if any(i < 0 or i >= vocab for i in ids):
            raise InvalidRequestError(f"prompt token ids must be in [0, {vocab})", "prompt")
        if params.golden_token_ids and max(params.golden_token_ids) >= vocab:
            raise InvalidRequestError(
                f"golden_token_ids must be in [0, {vocab})", "golden_token_ids"
            )
        request_id = request_id or self.new_request_id()
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", "request_id")
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        seq = Sequence(request_id, text, ids, params, seed)
        if arrival_time is not None:
            seq.arrival_time = arrival_time
        if self.tokenizer is not None:
            seq.detokenizer = IncrementalDetokenizer(
                self.tokenizer,
                ids,
                params.stop,
                params.include_stop_str_in_output,
                params.skip_special_tokens,
                params.min_tokens,
            )
        self.requests[request_id] = seq
        self._num_penalized += params.reads_output_tokens
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
            self._num_penalized -= seq.params.reads_output_tokens
            if self.drafter is not None:
                self.drafter.release(seq)
        return seq

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def fail_all(self, reason: FinishReason = FinishReason.ABORT) -> list[Sequence]:
        """After an internal error: end every unfinished request (blocks, slots freed) so the
        engine is clean again. Returns them; their terminal outputs come with the next step."""
        failed = [s for s in self.requests.values() if not s.is_finished]
        self._inflight = None  # its requests are all aborted below: nothing to read back
        for seq in failed:
            self.abort(seq.request_id)
        return failed

    # -- one step ---------------------------------------------------------------------------
    def step(self) -> list[TokenOutput]:
        """Synchronous: schedule, launch and process step N. Overlap: schedule and launch step
        N+1, then process step N (still running on the device until its readback arrives, while
        N+1 queues behind it), so the ledger is one step late; a step with no rows flushes."""
        t_start = time.perf_counter()
        if self.step_timer is not None:
            self.step_timer.begin_step(t_start)
        outputs: list[TokenOutput] = []
        overlap = self._overlap_now()
        flushed = False
        if self._inflight is not None and (not overlap or self._needs_sync()):
            # taken before processing: a step whose readback raised is not processed again
            inflight, self._inflight = self._inflight, None
            outputs += self._process(inflight, self.scheduler.step_id + 1, draft=True)
            flushed = True
            if self.overlap_when_paused and self.speculator is not None:
                # the drafting just done decides: drafts kept need the synchronous path; none
                # (speculation paused, or nothing to draft) lets this step run overlapped
                overlap = not self.speculator.has_drafts()
        batch = self.scheduler.schedule()
        self.pool.release_through(batch.step - 2)
        while self._terminal and self.pool.num_free > self.max_num_batched_tokens:
            outputs.append(self.ledger.terminal_output(self._terminal.pop(0), batch.step))
        launched = None
        if not batch.is_empty:
            self.num_steps += 1
            self.num_sync_steps += not overlap
            launched = self._launch(batch, overlap)
        if not overlap:
            if launched is not None:
                outputs += self._process(launched, batch.step, draft=True)
                if self.step_timer is not None:
                    self.step_timer.sync_step_processed(t_start, measured=not flushed)
        else:
            inflight, self._inflight = self._inflight, launched
            if inflight is not None:
                outputs += self._process(inflight, batch.step, draft=False)
        for out in outputs:
            if out.finished:
                self.forget(out.request_id)
        if self.step_timer is not None:
            self.step_timer.end_step(self.has_unfinished(), drained=self._inflight is None)
        if self.config.debug_invariants:
            self.check_invariants()
        return outputs

    def _overlap_now(self) -> bool:
        if self.overlap:
            return True
        return self.speculator is not None and self.speculator.may_overlap(
            self.scheduler.step_id + 1, in_flight=self._inflight is not None
        )

    def _needs_sync(self) -> bool:
        """Penalties read every output token on the host: a step with such a request waits for
        the step in flight first."""
        return self._num_penalized > 0

    def _launch(self, batch: StepBatch, overlap: bool) -> LaunchedStep:
        """Queue the step's forward and verification on the device; nothing waits for it."""
        t0 = time.perf_counter()
        assert not (overlap and any(batch.num_drafts)), "drafts need the synchronous path"
        seqs = [s for s, sm in zip(batch.seqs, batch.samples) if sm]
        self.timeline.begin("decode" if len(seqs) == batch.num_rows else "other")
        inputs = self.runner.prepare(batch)
        plan = draft_q = None
        if seqs:
            drafts = [d for d, sm in zip(batch.drafts, batch.samples) if sm]
            plan = self.sampler.plan(seqs, drafts)
            draft_q = self.speculator.draft_q(seqs, drafts) if self.speculator else None
        next_tokens = self.runner.next_tokens if overlap else None

        def device_part() -> SampledStep | None:
            logits = self.runner.forward(inputs)
            return self.sampler.execute(plan, logits, draft_q, next_tokens) if plan else None

        if overlap and self._worker is not None:
            # CPU: the forward runs in the worker while this thread runs the ledger of the
            # previous step and builds the next one (torch releases the GIL inside its ops)
            sampled: SampledStep | _WorkerStep | None = _WorkerStep(
                self._worker.submit(device_part)
            )
        else:
            sampled = device_part()
        if overlap:
            for s in seqs:
                s.num_pending += 1
        self.timeline.end()
        return LaunchedStep(batch, seqs, sampled, t0, overlap, self._inflight is not None)

    def _process(self, launched: LaunchedStep, out_step: int, draft: bool) -> list[TokenOutput]:
        """Wait for a launched step's results (the designed sync point), run the ledger and,
        with a drafter and draft=True (the next step is synchronous), draft the next step.
        Outputs belong to out_step for the pool."""
        batch, seqs = launched.batch, launched.seqs
        if self.step_timer is not None:
            self.step_timer.flush()  # the budget's bookkeeping, while the device runs the step
        host = launched.sampled.wait() if launched.sampled is not None else None
        if self.speculator is not None and host is not None:
            host = self.speculator.observe(batch, seqs, host)
        if self.step_timer is not None:
            self.step_timer.read_back(launched)
        outputs = self.ledger.process_outputs(batch, host, out_step)
        if self.speculator is not None and draft:
            self.speculator.propose()
        return outputs

    def release_outputs(self) -> None:
        """The caller has consumed every output handed out so far (e.g. the engine went idle):
        return them all to the pool."""
        self.pool.release_through(self.scheduler.step_id)

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
