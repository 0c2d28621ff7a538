"""The engine thread: one thread owns the LLMEngine and loops step() while there is work.

HTTP handlers never touch the engine. They send commands (add / abort / call) through a
thread-safe queue and receive each step's tokens on a per-request asyncio queue, fed with
loop.call_soon_threadsafe. So the event loop never blocks on the model, and the engine never
waits on a slow client: a step's outputs are copied out of the pooled TokenOutputs into plain
records before the next step can recycle them.

An exception inside step() fails the requests that were in the batch (500 for each) and the loop
keeps going; only the requests it touched are lost.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from specserve.distributed.errors import TensorParallelError
from specserve.engine.outputs import TokenOutput
from specserve.llm_engine import LLMEngine
from specserve.sampling_params import InvalidRequestError, SamplingParams
from specserve.server.errors import ServerError, internal_error
from specserve.server.metrics import EngineSnapshot, ServerMetrics
from specserve.server.stream import RequestStream, StepUpdate, TokenDelta, deliver_threadsafe

log = logging.getLogger("specserve.server")
T = TypeVar("T")


@dataclass(slots=True)
class _Live:
    """Engine-thread bookkeeping of one engine request."""

    stream: RequestStream
    index: int
    arrival: float
    first_token_time: float | None = None
    last_token_time: float = 0.0
    num_output_tokens: int = 0


@dataclass(slots=True)
class _Add:
    prompts: list[list[int]]
    params: list[SamplingParams]
    stream: RequestStream
    arrival: float
    future: concurrent.futures.Future


@dataclass(slots=True)
class _Abort:
    request_ids: list[str]


@dataclass(slots=True)
class _Call:
    fn: Callable[[LLMEngine], Any]
    future: concurrent.futures.Future


@dataclass(slots=True)
class _Fail:
    request_ids: list[str]
    error: ServerError


class _Stop:
    pass


class AsyncEngine:
    """The engine client the HTTP app talks to."""

    def __init__(self, engine: LLMEngine, model_name: str | None = None) -> None:
        self.engine = engine
        self.model_name = model_name or engine.model_name
        self.max_model_len = engine.max_model_len
        self.tokenizer = engine.tokenizer
        self.vocab_size = engine.model_config.vocab_size
        bm = engine.block_manager
        # the scheduler refuses a prompt whose KV (plus one token) cannot fit in the whole cache
        self.max_kv_tokens = bm.num_usable_blocks * engine.config.block_size
        self.metrics = ServerMetrics(self.model_name)
        self._cmds: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._live: dict[str, _Live] = {}
        # outputs handed out since the engine was last idle: every one is copied out at once,
        # so when the engine goes idle they all go back to the pool (invariant 6)
        self._outputs_out = False
        self._stopping = False
        self.dead: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="specserve-engine", daemon=True)
        self._thread.start()

    # ================================================================ asyncio side
    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.dead is None

    async def add(
        self,
        base_id: str,
        prompts: list[list[int]],
        params: list[SamplingParams],
        arrival: float,
    ) -> RequestStream:
        """Queue len(prompts) engine requests `{base_id}-{i}`; return once the engine took them.
        A request the engine refuses raises InvalidRequestError, with nothing left queued."""
        if not self.alive:
            raise ServerError("the engine is not running", 503, code="engine_dead")
        ids = [f"{base_id}-{i}" for i in range(len(prompts))]
        stream = RequestStream(asyncio.get_running_loop(), ids)
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._cmds.put(_Add(prompts, params, stream, arrival, fut))
        try:
            await asyncio.wrap_future(fut)
        except asyncio.CancelledError:
            self.abort(ids)  # FIFO: handled after the add, whichever ran first
            raise
        return stream

    def abort(self, request_ids: list[str]) -> None:
        self._cmds.put(_Abort(list(request_ids)))

    def fail(self, request_ids: list[str], error: ServerError) -> None:
        """End these requests with `error` (a drain past its grace period): their handler
        answers its client with it, and the engine frees their KV. Finished ones are skipped."""
        self._cmds.put(_Fail(list(request_ids), error))

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run fn(engine) in the engine thread, between two steps."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._cmds.put(_Call(fn, fut))
        return await asyncio.wrap_future(fut)

    def call_sync(self, fn: Callable[[LLMEngine], T], timeout: float | None = None) -> T:
        """call() for code outside the event loop (tests, the CLI)."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._cmds.put(_Call(fn, fut))
        return fut.result(timeout)

    def idle_state(self, eng: LLMEngine) -> dict[str, Any]:
        """Pass to call(): is the engine idle with every resource returned? (tests, debugging)"""
        return {
            "idle": not eng.has_unfinished() and not self._outputs_out and not self._live,
            "live": len(self._live),
            "used_blocks": eng.block_manager.num_used_blocks,
            "pool_free": eng.pool.num_free,
            "pool_capacity": eng.pool.capacity,
        }

    def shutdown(self, timeout: float = 10.0) -> None:
        self._cmds.put(_Stop())
        self._thread.join(timeout)

    # ================================================================ engine thread
    def _run(self) -> None:
        try:
            while not self._stopping:
                if not self._has_work():
                    self._handle(self._cmds.get())  # sleep until a command arrives
                while True:
                    try:
                        self._handle(self._cmds.get_nowait())
                    except queue.Empty:
                        break
                if self._stopping:
                    break
                if self.engine.has_unfinished():
                    self._step()
                    self._outputs_out = True
                elif self._outputs_out:
                    self.engine.release_outputs()
                    self._outputs_out = False
                self._publish()
        except BaseException as e:  # a bug in this loop itself: fail everyone, report unhealthy
            log.exception("engine thread died")
            self.dead = e
            self._fail(list(self._live), e)
        finally:
            for cmd in self._drain():
                if isinstance(cmd, (_Add, _Call)) and cmd.future.set_running_or_notify_cancel():
                    cmd.future.set_exception(ServerError("the engine stopped", 503))

    def _has_work(self) -> bool:
        return self.engine.has_unfinished() or self._outputs_out

    def _drain(self) -> list[Any]:
        out = []
        while True:
            try:
                out.append(self._cmds.get_nowait())
            except queue.Empty:
                return out

    def _handle(self, cmd: Any) -> None:
        if isinstance(cmd, _Add):
            self._handle_add(cmd)
        elif isinstance(cmd, _Abort):
            for rid in cmd.request_ids:
                if self._live.pop(rid, None) is not None:
                    self.engine.abort(rid)
                    self.metrics.on_aborted()
        elif isinstance(cmd, _Call):
            if cmd.future.set_running_or_notify_cancel():
                try:
                    cmd.future.set_result(cmd.fn(self.engine))
                except BaseException as e:
                    cmd.future.set_exception(e)
                # fn may have stepped the engine itself
                self._outputs_out = True
        elif isinstance(cmd, _Fail):
            for rid in cmd.request_ids:
                live = self._live.pop(rid, None)
                if live is not None:
                    self.engine.abort(rid)
                    self.metrics.on_aborted()
                    live.stream.put_threadsafe(StepUpdate(live.index, error=cmd.error))
        elif isinstance(cmd, _Stop):
            self._stopping = True

    def _handle_add(self, cmd: _Add) -> None:
        if not cmd.future.set_running_or_notify_cancel():
            return  # the client left before we got here: add nothing
        added: list[str] = []
        try:
            for i, (rid, prompt, params) in enumerate(
                zip(cmd.stream.request_ids, cmd.prompts, cmd.params)
            ):
                seq = self.engine.add_request(prompt, params, rid, cmd.arrival)
                added.append(rid)
                if seq.is_finished:  # the scheduler refused it (prompt_length_exceeded)
                    raise InvalidRequestError(
                        f"the prompt ({seq.num_prompt_tokens} tokens) does not fit in the KV cache "
                        f"({self.max_kv_tokens} tokens) or the context ({self.max_model_len} tokens)",
                        "prompt",
                    )
                self._live[rid] = _Live(cmd.stream, i, cmd.arrival)
                cmd.stream.num_prompt_tokens[i] = seq.num_prompt_tokens
        except BaseException as e:
            for rid in added:
                self._live.pop(rid, None)
                self.engine.abort(rid)
            cmd.future.set_exception(e)
            return
        self.metrics.on_added(sum(cmd.stream.num_prompt_tokens))
        cmd.future.set_result(None)

    def _guarded_step(self) -> list[TokenOutput] | None:
        try:
            return self.engine.step()
        except TensorParallelError:
            raise  # a worker is gone: the engine is over (health turns 503), not one batch
        except Exception as e:
            log.exception("engine step failed; failing the requests in its batch")
            self._recover(e)
            return None

    def _step(self) -> None:
        outs = self._guarded_step()
        if not outs:
            return
        now = time.perf_counter()
        updates: dict[str, StepUpdate] = {}
        for out in outs:
            live = self._live.get(out.request_id)
            if live is None:  # aborted by its client: nobody listens
                continue
            if out.finish_reason == "error":  # the engine isolated this request's failure: a 500
                updates.pop(out.request_id, None)  # for it alone (stop_reason says what failed)
                self._fail([out.request_id], RuntimeError(out.stop_reason or "request failed"))
                continue
            upd = updates.get(out.request_id)
            if upd is None:
                upd = updates[out.request_id] = StepUpdate(live.index)
            top = None
            if out.top_logprobs is not None:
                top = [
                    (t, lp.logprob, lp.decoded_token or "", lp.rank)
                    for t, lp in out.top_logprobs.items()
                ]
            upd.tokens.append(TokenDelta(out.token_id, out.text, out.logprob, top))
            if out.prompt_logprobs is not None:  # the request's first output only
                upd.prompt_logprobs = _copy_prompt_logprobs(out.prompt_logprobs)
            if out.finished:
                upd.finish_reason, upd.stop_reason = out.finish_reason, out.stop_reason
        batch: list[tuple[RequestStream, StepUpdate]] = []
        for rid, upd in updates.items():
            live = self._live[rid]
            n = upd.num_tokens
            if n:
                if live.first_token_time is None:
                    live.first_token_time = now
                    self.metrics.on_first_token(now - live.arrival)
                else:
                    self.metrics.on_step_tokens(now - live.last_token_time)
                live.last_token_time = now
                live.num_output_tokens += n
            if upd.finish_reason is not None:
                del self._live[rid]
                first_to_last = (
                    live.last_token_time - live.first_token_time if live.first_token_time else None
                )
                self.metrics.on_finished(
                    upd.finish_reason, now - live.arrival, first_to_last, live.num_output_tokens
                )
            batch.append((live.stream, upd))
        deliver_threadsafe(batch)

    def _recover(self, exc: Exception) -> None:
        """After a failed step: fail the requests of its batch, keep the others queued."""
        eng = self.engine
        affected = {s.request_id for s in eng.scheduler.running}
        # finished inside the failed step: their final outputs were lost with it
        affected |= {rid for rid, s in eng.requests.items() if s.is_finished}
        if not affected:  # the failure was not tied to the batch: nothing safe to keep
            affected = set(eng.requests)
        for rid in affected:
            try:
                eng.abort(rid)
            except Exception:
                log.exception("abort of %s after a failed step failed", rid)
        # a request that finished but whose terminal output is not queued would keep
        # has_unfinished() true forever (LLMEngine._terminal is the engine's report queue)
        pending = {s.request_id for s in eng._terminal}
        for rid in [r for r, s in eng.requests.items() if s.is_finished and r not in pending]:
            eng.forget(rid)
        self._fail([rid for rid in affected if rid in self._live], exc)

    def _fail(self, request_ids: list[str], exc: BaseException) -> None:
        err = internal_error(exc)
        for rid in request_ids:
            live = self._live.pop(rid, None)
            if live is not None:
                self.metrics.on_error()
                live.stream.put_threadsafe(StepUpdate(live.index, error=err))

    def _publish(self) -> None:
        eng = self.engine
        st = eng.stats()
        spec = eng.ledger.spec
        self.metrics.publish(
            EngineSnapshot(
                num_running=st.num_running,
                num_waiting=st.num_waiting,
                kv_usage=st.kv_usage,
                num_free_blocks=st.num_free_blocks,
                num_blocks=st.num_blocks,
                num_steps=eng.num_steps,
                generation_tokens=eng.ledger.num_generated_tokens,
                spec_drafts=spec.num_drafts,
                spec_draft_tokens=spec.num_draft_tokens,
                spec_accepted_tokens=spec.num_accepted_tokens,
                spec_verified_per_position=list(spec.verified_per_position),
                spec_accepted_per_position=list(spec.accepted_per_position),
                **_budget_fields(eng),
            )
        )


def _copy_prompt_logprobs(entries: list) -> list:
    """Plain tuples (token id, logprob, rank, decoded text or None) per prompt position."""
    return [
        None if e is None else [(t, lp.logprob, lp.rank, lp.decoded_token) for t, lp in e.items()]
        for e in entries
    ]


def _budget_fields(eng: LLMEngine) -> dict[str, Any]:
    b = eng.budget
    if b is None:
        return {}
    return {
        "budget_offered_draft_tokens": b.offered_rows,
        "budget_chosen_draft_tokens": b.chosen_rows,
        "budget_expected_accepted_tokens": b.expected_accepted,
        "budget_seqlens_q": b.seqlens_q(),
    }
