"""/v1/completions and /v1/chat/completions: validate, tokenize, fan out n engine requests, then
fold the engine's step updates into one OpenAI response or an SSE stream.

Both endpoints share everything except the prompt (text vs chat template) and the JSON shapes,
which live in `CompletionFormat` / `ChatFormat` (formats.py). Everything a request can get wrong
is checked before its prompt reaches the engine, and the work one request may queue is bounded
(prompts x n, characters before tokenizing): the preparation half, prepare.py.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from specserve.chat import chat_template_tools
from specserve.sampling_params import InvalidRequestError, SamplingParams
from specserve.server.async_engine import AsyncEngine
from specserve.server.errors import ServerError, bad_request, internal_error
from specserve.server.formats import (
    ChatFormat,
    ChoiceState,
    CompletionFormat,
    ResponseFormat,
    ToolOutput,
    prompt_logprobs_body,
    prompt_token_deltas,
)
from specserve.server.prepare import Prompt, RequestPreparation, invalid
from specserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
)
from specserve.server.responses import UsageInfo
from specserve.server.stream import RequestStream, StepUpdate, TokenDelta
from specserve.server.tokenizing import TokenizerLanes

log = logging.getLogger("specserve.server")


class OpenAIServing(RequestPreparation):
    def __init__(
        self,
        client: AsyncEngine,
        served_names: list[str],
        granularity: str,
        max_prompt_chars: int,
    ) -> None:
        super().__init__(client, served_names, max_prompt_chars)
        self.granularity = granularity
        self.draining = False  # set by the drain: no new engine requests
        self._streams: set[RequestStream] = set()  # this app's requests in the engine

    # -- endpoints ----------------------------------------------------------------------------
    async def completions(self, req: CompletionRequest, raw: Request) -> Response:
        arrival = time.perf_counter()
        req.check()
        model = self.check_model(req.model)
        spec, spec_field = req.structured_spec()
        prompts = await self.completion_prompts(req)
        # echo with max_tokens 0 scores the prompt: one token runs and is dropped (as vLLM)
        requested = 1 if req.echo_only else req.max_tokens
        structured = await self.structured(spec, spec_field)
        params = self.build_params(
            req, prompts, requested, "max_tokens", "prompt", req.logprobs,
            req.engine_prompt_logprobs, {"structured_outputs": spec_field}, structured,
        )  # fmt: skip
        fmt = CompletionFormat(_response_id("cmpl", req.request_id), model, req.logprobs)
        return await self._run(req, fmt, prompts, params, arrival, raw)

    async def chat(self, req: ChatCompletionRequest, raw: Request) -> Response:
        arrival = time.perf_counter()
        req.check()
        model = self.check_model(req.model)
        self.check_fanout(1, req.n)
        spec, spec_field = req.structured_spec()
        fns, choice, constraint = self.chat_tools(req)
        if constraint is not None:
            if spec is not None:
                raise bad_request(
                    f"tool_choice {choice!r} cannot be combined with {spec_field}", "tool_choice"
                )
            spec, spec_field = constraint, "tool_choice"
        text, ids = await self.chat_prompt(req, fns)
        prompt = Prompt(self.truncate(ids, req.truncate_prompt_tokens), text, req.echo_text())
        requested, field = req.requested_max_tokens
        top = (req.top_logprobs or 0) if req.logprobs else None
        rename = {"max_tokens": field, "logprobs": "top_logprobs", "structured_outputs": spec_field}
        structured = await self.structured(spec, spec_field)
        params = self.build_params(
            req, [prompt], requested, field, "messages", top, req.prompt_logprobs, rename,
            structured,
        )  # fmt: skip
        prompt_text = text if req.return_prompt_text else None
        tools = None
        if fns and choice != "none":
            tools = ToolOutput(
                chat_template_tools(self.client.tokenizer).format,
                choice,
                req.parallel_tool_calls is not False,
            )
        fmt = ChatFormat(_response_id("chatcmpl", req.request_id), model, top, prompt_text, tools)
        return await self._run(req, fmt, [prompt], params, arrival, raw)

    # -- shared driver ------------------------------------------------------------------------
    async def _run(
        self,
        req: CompletionRequest | ChatCompletionRequest,
        fmt: ResponseFormat,
        prompts: list[Prompt],
        params: list[SamplingParams],
        arrival: float,
        raw: Request,
    ) -> Response:
        n = req.n
        if self.draining:
            raise ServerError("the server is shutting down", 503, code="shutting_down")
        engine_prompts = [p.ids for p in prompts for _ in range(n)]
        try:
            stream = await self.client.add(
                f"req-{uuid.uuid4().hex}", engine_prompts, params, arrival
            )
        except InvalidRequestError as e:
            raise invalid(e) from None
        self._streams.add(stream)
        fmt.return_token_ids = bool(req.return_token_ids)
        fmt.tokens_as_ids = bool(req.return_tokens_as_token_ids)
        usage = UsageInfo(prompt_tokens=sum(len(p.ids) for p in prompts))
        echo_only = isinstance(req, CompletionRequest) and req.echo_only
        states = [
            ChoiceState(
                prompt_token_ids=p.ids,
                echo_text=p.echo_text,
                echo_pending=True,
                drop_tokens=echo_only,
            )
            for p in prompts
            for _ in range(n)
        ]
        wants_echo_logprobs = (
            isinstance(req, CompletionRequest) and req.echo and (req.logprobs is not None)
        )
        prompt_lps = FirstUpdate(self.lanes, req.prompt_logprobs is not None, wants_echo_logprobs)
        if req.stream:
            granularity = req.stream_granularity or self.granularity
            body = self._sse(
                stream, fmt, states, usage, req.include_usage, req.continuous_usage, granularity,
                prompt_lps,
            )  # fmt: skip
            headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
            return _EngineStreamResponse(
                body,
                on_close=lambda: self._close(stream),
                media_type="text/event-stream",
                headers=headers,
            )
        collect = asyncio.ensure_future(self._collect(stream, states, prompt_lps))
        watch = asyncio.ensure_future(_until_disconnected(raw))
        try:
            done, _ = await asyncio.wait({collect, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            if not collect.done():
                collect.cancel()
            self._close(stream)  # the client left: free its KV now; else a no-op
        if collect not in done:
            return Response(status_code=499)  # nobody reads it; nginx's "client closed request"
        collect.result()  # raises the engine's ServerError, if any
        usage.completion_tokens = sum(s.num_tokens for s in states)
        usage.total_tokens = usage.prompt_tokens + usage.completion_tokens
        return JSONResponse(fmt.full_response(states, usage).model_dump(mode="json"))

    def _close(self, stream: RequestStream) -> None:
        if stream in self._streams:
            self._streams.discard(stream)
            self.client.abort(stream.request_ids)  # a no-op for finished requests

    def fail_in_flight(self, error: ServerError) -> int:
        """End this app's requests still in the engine with `error` (the drain's deadline)."""
        streams = list(self._streams)
        for s in streams:
            self.client.fail(s.request_ids, error)
        return len(streams)

    async def _collect(
        self, stream: RequestStream, states: list[ChoiceState], prompt_lps: FirstUpdate
    ) -> None:
        async for upd in stream.updates():
            state = states[upd.index]
            await prompt_lps.apply(upd, state)
            state.add(upd.tokens, upd.finish_reason, upd.stop_reason)

    async def _sse(
        self,
        stream: RequestStream,
        fmt: ResponseFormat,
        states: list[ChoiceState],
        usage: UsageInfo,
        include_usage: bool,
        continuous_usage: bool,
        granularity: str,
        prompt_lps: FirstUpdate,
    ) -> AsyncIterator[str]:
        def usage_of(state: ChoiceState) -> UsageInfo:
            p, c = len(state.prompt_token_ids), state.num_tokens
            return UsageInfo(prompt_tokens=p, completion_tokens=c, total_tokens=p + c)

        try:
            for chunk in fmt.first_chunks(len(states)):
                yield _event(chunk.model_dump_json())
            async for upd in stream.updates():
                state = states[upd.index]
                if state.echo_pending:
                    state.echo_pending = False
                    await prompt_lps.apply(upd, state)
                    echo = fmt.echo_chunk(upd.index, state)
                    if echo is not None:
                        yield _event(echo.model_dump_json())
                for tokens, last in _split(upd, granularity):
                    state.add(tokens, upd.finish_reason if last else None, upd.stop_reason)
                    finish = upd.finish_reason if last else None
                    chunk = fmt.chunk(upd.index, tokens, state, finish)
                    if continuous_usage:
                        chunk.usage = usage_of(state)
                    yield _event(chunk.model_dump_json())
            if include_usage:
                usage.completion_tokens = sum(s.num_tokens for s in states)
                usage.total_tokens = usage.prompt_tokens + usage.completion_tokens
                yield _event(fmt.usage_chunk(usage).model_dump_json())
        except ServerError as e:
            yield _event(e.response().model_dump_json())
        except Exception as e:  # a bug of ours while formatting: this stream only
            log.exception("stream %s failed", fmt.id)
            yield _event(internal_error(e).response().model_dump_json())
        finally:
            # runs on normal end, on error, and when Starlette cancels us on client disconnect
            self._close(stream)
        yield "data: [DONE]\n\n"


class FirstUpdate:
    """Turns the prompt logprobs of a choice's first update into what the request asked for:
    the `prompt_logprobs` field, and (completions, echo with logprobs) the prompt's tokens at
    the head of the logprobs. Token texts are decoded in a tokenizer lane."""

    def __init__(self, lanes: TokenizerLanes, field: bool, echo: bool) -> None:
        self.lanes, self.field, self.echo = lanes, field, echo

    async def apply(self, upd: StepUpdate, state: ChoiceState) -> None:
        raw = upd.prompt_logprobs
        if raw is None or not (self.field or self.echo):
            return
        known: dict[int, str] = {}
        for entry in raw:
            for t, _, _, text in entry or ():
                if text is not None:
                    known[t] = text
        need = {t for entry in raw for t, *_ in entry or ()} | set(state.prompt_token_ids)
        missing = sorted(need - known.keys())
        if missing:
            known.update(zip(missing, await self.lanes.token_strings(missing)))
        if self.field:
            state.prompt_logprobs = prompt_logprobs_body(raw, known)
        if self.echo:
            state.set_echo_tokens(prompt_token_deltas(state.prompt_token_ids, raw, known))


def _response_id(prefix: str, request_id: str | None) -> str:
    return f"{prefix}-{request_id or uuid.uuid4().hex}"


class _EngineStreamResponse(StreamingResponse):
    """SSE response that aborts its engine requests however it ends. The generator's own
    `finally` covers disconnects mid-stream; this also covers a client gone before the first
    chunk, when Starlette cancels the response before the generator ever started (an abort
    of finished requests is a no-op)."""

    def __init__(
        self, content: AsyncIterator[str], on_close: Callable[[], None], **kw: Any
    ) -> None:
        super().__init__(content, **kw)
        self._on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def _event(data: str) -> str:
    return f"data: {data}\n\n"


def _split(upd: StepUpdate, granularity: str) -> list[tuple[list[TokenDelta], bool]]:
    """The chunks of one step update: all its tokens at once, or one token per chunk. Text
    without a token (flushed at finish) rides on the last chunk."""
    if granularity != "token" or len(upd.tokens) <= 1:
        return [(upd.tokens, True)]
    groups: list[list[TokenDelta]] = []
    for t in upd.tokens:
        if t.token_id >= 0 or not groups:
            groups.append([t])
        else:
            groups[-1].append(t)
    return [(g, i == len(groups) - 1) for i, g in enumerate(groups)]


async def _until_disconnected(raw: Request) -> None:
    """Returns when the client closes the connection (the body was already read)."""
    while True:
        message = await raw.receive()
        if message["type"] == "http.disconnect":
            return
