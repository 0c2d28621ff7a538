"""The engine: one step = schedule -> forward -> verify -> process_outputs (the ledger)."""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass

from specserve.config import EngineConfig
from specserve.distributed import TensorParallelError
from specserve.engine.admission import admit
from specserve.engine.cpu_threads import apply_cpu_threads, on_own_thread
from specserve.engine.device import resolve_device
from specserve.engine.isolation import FaultIsolation
from specserve.engine.ledger import HostStepResult
from specserve.engine.outputs import TokenOutput
from specserve.engine.scheduler import StepBatch
from specserve.engine.sequence import FinishReason, Sequence
from specserve.engine_build import build
from specserve.model.quant import quantize_engine
from specserve.sampling_params import SamplingParams
from specserve.speculative.row_plan import plan_rows
from specserve.step_launch import LaunchedStep, settle

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
    """Steps requests: schedule, launch the step's device work, read it back, run the ledger.

    Its parts are built by engine_build.py: the model (target_model, model_config, tokenizer,
    tp), KV cache and runner (num_kv_blocks, block_manager, runner), speculation (drafter and
    speculator on the host, device_drafting inside the step; slot_pool, budget), scheduler,
    ledger, output pool (pool), sampler, launcher, grammars, timeline."""

    def __init__(self, config: EngineConfig, progress: bool = True) -> None:
        self.config = config
        self.requests: dict[str, Sequence] = {}
        self._terminal: list[Sequence] = []  # ended without a token; reported next step
        self.seed_rng = random.Random(config.seed)  # seeds of requests that set none
        self._next_id = 0
        self.num_steps = 0
        self.num_sync_steps = 0  # launched synchronously (host drafts, or overlap off)
        # launched behind the step in flight with their sampling queued after its ledger (a
        # request reads its output tokens on the host: step_launch.py)
        self.num_deferred_steps = 0
        # steps with prompt rows (mixed buckets on CUDA, runner/cuda_graph.py)
        self.num_prompt_steps = 0
        self._inflight: LaunchedStep | None = None  # overlap: launched, not yet through the ledger
        self._isolation: FaultIsolation | None = None  # a failed step's requests being searched
        self._last_readback: float | None = None  # of the last step read back (_step_seconds)
        # the model, KV cache, runner, speculation, scheduler and ledger (engine_build.py)
        build(self, config, progress)

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
        words) queues its forward first and its sampling after N's ledger (step_launch.py).

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
            if self._inflight is not None:
                # a step launched for requests that have all finished since: a caller that
                # stops stepping now reads it back only after its pause, which is no step's cost
                self._inflight.timed = False
        if self.config.debug_invariants:
            self.check_invariants()
        return outputs

    def _step(self) -> list[TokenOutput]:
        outputs: list[TokenOutput] = []
        overlap = self._overlap_now()
        # a step that is all requests' last if the drafts in flight are accepted waits for them
        drain = overlap and self._inflight is not None and self.scheduler.all_may_end()
        if self._inflight is not None and (drain or not overlap):
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
        caps, split_total = plan_rows(self)
        batch = self.scheduler.schedule(draft_caps=caps)
        if split_total is not None and batch.is_decode_shaped and batch.num_rows > split_total:
            batch.split_total = split_total
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
                if launched is not None and not (
                    launched.timed and launched.batch.is_decode_shaped
                ):
                    # the period of the step in flight holds this launch's host work: a prompt
                    # step's or a drafting switch's (a model drafter's gap catch-up), one-off
                    # work of neither step's steady kind; priced, it makes a plain step look
                    # several times dearer than it is, and drafting "pays"
                    inflight.timed = False
                outputs += self._process_in_flight(inflight, launched, batch.step)
            if self._inflight is not None and self._inflight.deferred is not None:
                self._finish_deferred(self._inflight)  # planned from the tokens just committed
            # the text of the step just committed, now that the next one's device work is all
            # queued (a deferred step's sampling waited for the ledger, not for this)
            self.ledger.fill_text(outputs)
        return outputs

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
        """Queue the step's device work (step_launch.py); nothing waits for it."""
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
        if self.budget is not None and (seconds := self._step_seconds(launched)) is not None:
            rows = launched.rows or batch.num_rows
            if not (launched.from_drafts and launched.drafted):
                self.budget.observe_step(rows, seconds)
            elif host is not None:  # a steady drafting step of a model drafter
                n = len(host.num_accepted)
                self.budget.observe_drafting(n, n + sum(host.num_accepted), rows, seconds)
        if self.speculator is not None and host is not None:
            host = self.speculator.observe(batch, seqs, host)
        if self.device_drafting is not None and host is not None:
            self.device_drafting.observe(seqs, host, launched.drafted)
        return host

    def _step_seconds(self, launched: LaunchedStep) -> float | None:
        """What a decode/verify step cost the run, for the verify budget: the time between its
        readback and the previous one, i.e. its device time plus the host work of a step that
        overlap does not hide (ledger, drafting, scheduling). The first step after the engine
        was idle has no such period: its launch-to-readback. None for a step the budget does
        not learn from: prompt chunks cost far less per row, and a model drafter's switch
        between drafting and plain steps is neither (LaunchedStep.timed). Nor is a step read
        back after the engine went idle (step())."""
        now = time.perf_counter()
        last, self._last_readback = self._last_readback, now
        if not (launched.timed and launched.batch.is_decode_shaped):
            return None
        return now - (last if last is not None else launched.t0)

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


def build_engine(config: EngineConfig, progress: bool = True) -> LLMEngine:
    """A ready engine, as LLM and `specserve serve` start one: torch's CPU threads sized, the
    engine built, its layers quantized (config.quantization). A CPU engine is built on a
    thread of its own (cpu_threads.on_own_thread: the thread that steps it keeps the only
    OpenMP pool)."""
    apply_cpu_threads(config.device)  # before the engine: its overlap worker copies the count
    if resolve_device(config.device).type == "cpu":
        return on_own_thread(_build, config, progress)
    return _build(config, progress)


def _build(config: EngineConfig, progress: bool) -> LLMEngine:
    engine = LLMEngine(config, progress=progress)
    quantize_engine(engine)  # no-op unless config.quantization
    return engine
