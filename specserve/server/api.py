"""The FastAPI app: routes, API-key check, the guard middleware, OpenAI-shaped errors for all.

Bodies are read and parsed by validation.py rather than by FastAPI's automatic validation so
that every failure gets our error shape and names the parameter.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from specserve import __version__
from specserve.server.async_engine import AsyncEngine
from specserve.server.compat import check_chat_body, check_completion_body
from specserve.server.errors import ServerError, bad_request, error_body, status_phrase
from specserve.server.guard import DrainState, Guard
from specserve.server.protocol import ChatCompletionRequest, CompletionRequest
from specserve.server.responses import ModelCard, ModelList
from specserve.server.serving import OpenAIServing
from specserve.server.tokenizing import CHARS_PER_TOKEN_BOUND
from specserve.server.tokens_api import detokenize, tokenize
from specserve.server.validation import ClientGone, parse_json_body, read_body, validate_body

log = logging.getLogger("specserve.server")

DEFAULT_MAX_BODY_BYTES = 8 * 2**20


@dataclass
class AppOptions:
    served_model_names: list[str] | None = None
    api_key: str | None = None
    metrics_without_key: bool = False  # with an API key, /metrics needs it too unless this
    stream_granularity: str = "step"
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_prompt_chars: int | None = None  # None: max_model_len x CHARS_PER_TOKEN_BOUND
    allowed_origins: list[str] = field(default_factory=list)  # "*": any
    check_host: bool = False  # loopback-bound: Host must be loopback (DNS rebinding)
    allowed_hosts: list[str] = field(default_factory=list)


def build_app(client: AsyncEngine, opts: AppOptions | None = None) -> FastAPI:
    """The OpenAI-compatible app around a running AsyncEngine (the caller owns its lifetime).
    app.state.serving and app.state.drain are what a graceful shutdown drives."""
    opts = opts or AppOptions()
    names = opts.served_model_names or [client.model_name]
    max_chars = opts.max_prompt_chars or client.max_model_len * CHARS_PER_TOKEN_BOUND
    serving = OpenAIServing(client, names, opts.stream_granularity, max_chars)
    drain = DrainState()
    app = FastAPI(title="specserve", version=__version__, docs_url=None, redoc_url=None)
    app.state.client, app.state.serving, app.state.drain = client, serving, drain
    app.add_middleware(
        Guard,
        allowed_origins=opts.allowed_origins,
        check_host=opts.check_host,
        allowed_hosts=opts.allowed_hosts,
        drain=drain,
    )

    # -- errors -------------------------------------------------------------------------------
    def error_response(err: ServerError) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if err.status == 401 else None
        return JSONResponse(err.response().model_dump(), err.status, headers=headers)

    @app.exception_handler(ServerError)
    async def _server_error(_: Request, exc: ServerError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(ClientGone)
    async def _client_gone(_: Request, exc: ClientGone) -> Response:
        return Response(status_code=499)  # nobody reads it

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        msg = exc.detail if isinstance(exc.detail, str) else status_phrase(exc.status_code)
        return error_response(ServerError(msg, exc.status_code))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(bad_request(f"invalid request: {exc.errors()}"))

    @app.exception_handler(Exception)
    async def _internal_error(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error in a request handler")
        body = error_body(
            f"internal error: {type(exc).__name__}: {exc}", 500, code="internal_error"
        )
        return JSONResponse(body.model_dump(), 500)

    # -- auth ---------------------------------------------------------------------------------
    async def check_api_key(request: Request) -> None:
        if opts.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        ok = scheme.lower() == "bearer" and hmac.compare_digest(
            token.strip().encode(), opts.api_key.encode()
        )
        if not ok:
            msg = (
                "invalid API key"
                if header
                else "missing API key: send 'Authorization: Bearer <key>'"
            )
            raise ServerError(msg, 401, code="invalid_api_key")

    guarded = [Depends(check_api_key)]

    async def body_of(request: Request, check: Callable[[dict], None] | None = None) -> dict:
        data = parse_json_body(await read_body(request, opts.max_body_bytes))
        if check is not None:
            check(data)  # refused fields, named, before any typing
        return data

    # -- OpenAI endpoints ---------------------------------------------------------------------
    @app.post("/v1/completions", dependencies=guarded)
    async def completions(request: Request) -> Response:
        data = await body_of(request, check_completion_body)
        return await serving.completions(validate_body(CompletionRequest, data), request)

    @app.post("/v1/chat/completions", dependencies=guarded)
    async def chat_completions(request: Request) -> Response:
        data = await body_of(request, check_chat_body)
        return await serving.chat(validate_body(ChatCompletionRequest, data), request)

    def card(name: str) -> ModelCard:
        return ModelCard(id=name, root=client.model_name, max_model_len=client.max_model_len)

    @app.get("/v1/models", dependencies=guarded)
    async def models() -> JSONResponse:
        return JSONResponse(ModelList(data=[card(n) for n in names]).model_dump())

    @app.get("/v1/models/{model_id:path}", dependencies=guarded)
    async def model(model_id: str) -> JSONResponse:
        if model_id not in names:
            raise ServerError(
                f"The model {model_id!r} does not exist", 404, "model", "model_not_found"
            )
        return JSONResponse(card(model_id).model_dump())

    # -- vLLM's tokenizer endpoints -----------------------------------------------------------
    def json_route(
        fn: Callable[[OpenAIServing, dict], Awaitable[object]],
    ) -> Callable[[Request], Awaitable[JSONResponse]]:
        async def route(request: Request) -> JSONResponse:
            result = await fn(serving, await body_of(request))
            return JSONResponse(result.model_dump(mode="json"))  # type: ignore[attr-defined]

        return route

    app.add_api_route("/tokenize", json_route(tokenize), methods=["POST"], dependencies=guarded)
    app.add_api_route("/detokenize", json_route(detokenize), methods=["POST"], dependencies=guarded)

    # -- operations ---------------------------------------------------------------------------
    @app.get("/health")
    async def health() -> Response:
        if client.alive:
            return Response(status_code=200)
        return error_response(
            ServerError("the engine thread is not running", 503, code="engine_dead")
        )

    metrics_guard = [] if opts.metrics_without_key else guarded

    @app.get("/metrics", dependencies=metrics_guard)
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(client.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": __version__})

    return app
