"""/v1/completions and /v1/chat/completions: validate, tokenize, fan out n engine requests, then
fold the engine's step updates into one OpenAI response or an SSE stream.

Both endpoints share everything except the prompt (text vs chat template) and the JSON shapes,
which live in `CompletionFormat` / `ChatFormat` (formats.py).
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from specserve.sampling_params import InvalidRequestError, SamplingParams
from specserve.server.async_engine import AsyncEngine
from specserve.server.errors import ServerError, bad_request, internal_error
from specserve.server.formats import ChatFormat, ChoiceState, CompletionFormat, ResponseFormat
from specserve.server.protocol import ChatCompletionRequest, CompletionRequest, UsageInfo
from specserve.server.stream import RequestStream, StepUpdate, TokenDelta

log = logging.getLogger("specserve.server")
SEED_MASK = 2**63 - 1


def derive_seed(seed: int, i: int) -> int:
    """Seed of the i-th sample of a prompt: the request's seed for i = 0 (so n=1 reproduces a
    plain seeded request), a distinct hash of (seed, i) for the others."""
    if i == 0:
        return seed
    x = (seed * 0x9E3779B97F4A7C15 + i * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x ^= x >> 31
    return x & SEED_MASK


class OpenAIServing:
    def __init__(self, client: AsyncEngine, served_names: list[str], granularity: str) -> None:
        self.client = client
        self.served_names = served_names
        self.granularity = granularity

    # -- validation ---------------------------------------------------------------------------
    def check_model(self, name: str | None) -> str:
        if name is not None and name not in self.served_names:
            raise bad_request(
                f"model {name!r} does not exist; this server serves {self.served_names}",
                "model",
                "model_not_found",
            )
        return name or self.served_names[0]

    def max_tokens_for(self, n_prompt: int, requested: int | None, field: str, what: str) -> int:
        """The max_tokens to run with; 400 when the prompt, or prompt + max_tokens, cannot fit."""
        limit = self.client.max_model_len
        if n_prompt >= limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens. However, your request "
                f"has {n_prompt} input tokens in the {what}, leaving no room for output. Please reduce "
                f"the length of the input.",
                "messages" if what == "messages" else "prompt",
                "context_length_exceeded",
            )
        if n_prompt + 1 > self.client.max_kv_tokens:
            raise bad_request(
                f"The prompt has {n_prompt} tokens but the KV cache holds only "
                f"{self.client.max_kv_tokens} tokens. Please reduce the length of the input.",
                "messages" if what == "messages" else "prompt",
                "context_length_exceeded",
            )
        if requested is None:
            return limit - n_prompt
        if requested < 1:
            raise bad_request(f"{field} must be at least 1, got {requested}", field)
        if n_prompt + requested > limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{n_prompt + requested} tokens ({n_prompt} in the {what}, {requested} in the "
                f"completion). Please reduce the length of the {what} or {field}.",
                field,
                "context_length_exceeded",
            )
        return requested

    def build_params(
        self,
        req: CompletionRequest | ChatCompletionRequest,
        prompts: list[list[int]],
        requested: int | None,
        field: str,
        what: str,
        logprobs: int | None,
        rename: dict[str, str],
    ) -> list[SamplingParams]:
        params: list[SamplingParams] = []
        for ids in prompts:
            max_tokens = self.max_tokens_for(len(ids), requested, field, what)
            try:
                base = req.sampling_params(max_tokens, logprobs)
            except InvalidRequestError as e:
                param = rename.get(e.param or "", e.param)
                raise bad_request(str(e), param) from None
            for i in range(req.n):
                sp = base if i == 0 else _with_seed(base, req.seed, i)
                params.append(sp)
        return params

    async def encode(self, text: str, param: str) -> list[int]:
        if text == "":
            raise bad_request("prompt must not be empty", param)
        tok = self.client.tokenizer
        if tok is None:
            raise bad_request("this model has no tokenizer: send token ids", param)
        try:
            text.encode("utf-8")  # JSON may carry lone surrogates ("\ud800") no tokenizer takes
        except UnicodeEncodeError as e:
            raise bad_request(f"{param} is not valid Unicode: {e.reason}", param) from None
        return await self.client.run_tokenizer(tok.encode, text)

    async def completion_prompts(self, req: CompletionRequest) -> list[list[int]]:
        p = req.prompt
        if isinstance(p, str):
            return [await self.encode(p, "prompt")]
        if not p:
            raise bad_request("prompt must not be empty", "prompt")
        if isinstance(p[0], int):
            return [list(p)]  # type: ignore[arg-type]
        out: list[list[int]] = []
        for item in p:
            if isinstance(item, str):
                out.append(await self.encode(item, "prompt"))
            elif not item:
                raise bad_request("prompt token id lists must not be empty", "prompt")
            else:
                out.append(list(item))
        return out

    async def chat_prompt(self, req: ChatCompletionRequest) -> list[int]:
        tok = self.client.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise bad_request("this model has no chat template; use /v1/completions", "messages")
        messages = req.template_messages()

        def render() -> list[int]:
            out = tok.apply_chat_template(
                messages, add_generation_prompt=req.add_generation_prompt, tokenize=True
            )
            if isinstance(out, dict) or hasattr(out, "input_ids"):
                out = out["input_ids"]
            return list(out)

        try:
            return await self.client.run_tokenizer(render)
        except Exception as e:  # jinja raises for conversations the template refuses
            raise bad_request(f"the chat template rejected these messages: {e}", "messages") from e

    # -- endpoints ----------------------------------------------------------------------------
    async def completions(self, req: CompletionRequest, raw: Request) -> Response:
        arrival = time.perf_counter()
        req.check()
        model = self.check_model(req.model)
        prompts = await self.completion_prompts(req)
        rename = {"max_tokens": "max_tokens"}
        params = self.build_params(
            req, prompts, req.max_tokens, "max_tokens", "prompt", req.logprobs, rename
        )
        fmt = CompletionFormat(f"cmpl-{uuid.uuid4().hex}", model, req.logprobs)
        return await self._run(req, fmt, prompts, params, arrival, raw)

    async def chat(self, req: ChatCompletionRequest, raw: Request) -> Response:
        arrival = time.perf_counter()
        req.check()
        model = self.check_model(req.model)
        prompt = await self.chat_prompt(req)
        requested, field = req.requested_max_tokens
        top = (req.top_logprobs or 0) if req.logprobs else None
        rename = {"max_tokens": field, "logprobs": "top_logprobs"}
        params = self.build_params(req, [prompt], requested, field, "messages", top, rename)
        fmt = ChatFormat(f"chatcmpl-{uuid.uuid4().hex}", model, top)
        return await self._run(req, fmt, [prompt], params, arrival, raw)

    # -- shared driver ------------------------------------------------------------------------
    async def _run(
        self,
        req: CompletionRequest | ChatCompletionRequest,
        fmt: ResponseFormat,
        prompts: list[list[int]],
        params: list[SamplingParams],
        arrival: float,
        raw: Request,
    ) -> Response:
        n = req.n
        engine_prompts = [ids for ids in prompts for _ in range(n)]
        base_id = fmt.id
        try:
            stream = await self.client.add(base_id, engine_prompts, params, arrival)
        except InvalidRequestError as e:
            raise bad_request(str(e), e.param) from None
        fmt.return_token_ids = req.return_token_ids
        usage = UsageInfo(prompt_tokens=sum(len(p) for p in prompts))
        states = [ChoiceState() for _ in engine_prompts]
        if req.stream:
            granularity = req.stream_granularity or self.granularity
            body = self._sse(stream, fmt, states, usage, req.include_usage, granularity)
            headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
            return _EngineStreamResponse(
                body,
                on_close=lambda: self.client.abort(stream.request_ids),
                media_type="text/event-stream",
                headers=headers,
            )
        collect = asyncio.ensure_future(self._collect(stream, states))
        watch = asyncio.ensure_future(_until_disconnected(raw))
        try:
            done, _ = await asyncio.wait({collect, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            if not collect.done():
                collect.cancel()
                self.client.abort(stream.request_ids)  # the client left: free its KV now
        if collect not in done:
            return Response(status_code=499)  # nobody reads it; nginx's "client closed request"
        collect.result()  # raises the engine's ServerError, if any
        usage.completion_tokens = sum(s.num_tokens for s in states)
        usage.total_tokens = usage.prompt_tokens + usage.completion_tokens
        return JSONResponse(fmt.full_response(states, usage).model_dump(mode="json"))

    async def _collect(self, stream: RequestStream, states: list[ChoiceState]) -> None:
        finished = False
        try:
            async for upd in stream.updates():
                states[upd.index].add(upd.tokens, upd.finish_reason, upd.stop_reason)
            finished = True
        finally:
            if not finished:
                self.client.abort(stream.request_ids)

    async def _sse(
        self,
        stream: RequestStream,
        fmt: ResponseFormat,
        states: list[ChoiceState],
        usage: UsageInfo,
        include_usage: bool,
        granularity: str,
    ) -> AsyncIterator[str]:
        finished = False
        try:
            for chunk in fmt.first_chunks(len(states)):
                yield _event(chunk.model_dump_json())
            async for upd in stream.updates():
                for tokens, last in _split(upd, granularity):
                    state = states[upd.index]
                    state.add(tokens, upd.finish_reason if last else None, upd.stop_reason)
                    finish = upd.finish_reason if last else None
                    chunk = fmt.chunk(upd.index, tokens, state, finish)
                    yield _event(chunk.model_dump_json())
            finished = True
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
            if not finished:
                self.client.abort(stream.request_ids)
        yield "data: [DONE]\n\n"


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


def _with_seed(base: SamplingParams, seed: int | None, i: int) -> SamplingParams:
    sp = copy.copy(base)
    if seed is not None:
        sp.seed = derive_seed(seed, i)
    return sp


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


def parse_json_body(body: bytes) -> dict:
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise bad_request(f"request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise bad_request("request body must be a JSON object", code="invalid_json")
    return data
