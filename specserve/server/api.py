"""The FastAPI app: routes, API-key check, body limits, and OpenAI-shaped errors for everything.

Bodies are read and parsed here rather than by FastAPI's automatic validation so that every
failure (too large, not JSON, wrong types) gets our error shape and names the parameter.
"""

from __future__ import annotations

import hmac
import logging
from typing import Any, TypeVar

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from specserve import __version__
from specserve.server.async_engine import AsyncEngine
from specserve.server.errors import ServerError, bad_request, error_body, status_phrase
from specserve.server.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from specserve.server.serving import OpenAIServing, parse_json_body

log = logging.getLogger("specserve.server")
M = TypeVar("M", bound=BaseModel)

DEFAULT_MAX_BODY_BYTES = 8 * 2**20
_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none"}


def _param_path(loc: tuple[Any, ...]) -> str | None:
    """pydantic's error location as a parameter path, without union-member tags:
    ('messages', 0, 'role') -> 'messages[0].role'; ('prompt', 'list[int]', 3) -> 'prompt[3]'."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif isinstance(part, str):
            tag = part in _TYPE_TAGS or "[" in part or part[:1].isupper() or "-" in part
            if not tag:
                out += f".{part}" if out else part
    return out or None


def validate_body(model: type[M], data: dict) -> M:
    try:
        return model.model_validate(data)
    except ValidationError as e:
        errors = e.errors(include_url=False)
        first = _param_path(tuple(errors[0]["loc"])) if errors else None
        # a union reports one error per member; the first few say enough
        details = "; ".join(
            f"{_param_path(tuple(x['loc'])) or 'body'}: {x['msg']}" for x in errors[:3]
        )
        raise bad_request(f"invalid request: {details}", first) from None


async def read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            size = int(declared)
        except ValueError:
            raise bad_request("invalid Content-Length header") from None
        if size > limit:
            raise ServerError(f"request body of {size} bytes exceeds the {limit}-byte limit", 413)
    chunks, size = [], 0
    async for chunk in request.stream():  # also bounds chunked bodies with no Content-Length
        size += len(chunk)
        if size > limit:
            raise ServerError(f"request body exceeds the {limit}-byte limit", 413)
        chunks.append(chunk)
    return b"".join(chunks)


def build_app(
    client: AsyncEngine,
    served_model_names: list[str] | None = None,
    api_key: str | None = None,
    stream_granularity: str = "step",
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
) -> FastAPI:
    """The OpenAI-compatible app around a running AsyncEngine (the caller owns its lifetime)."""
    names = served_model_names or [client.model_name]
    serving = OpenAIServing(client, names, stream_granularity)
    app = FastAPI(title="specserve", version=__version__, docs_url=None, redoc_url=None)
    app.state.client = client

    # -- errors -------------------------------------------------------------------------------
    def error_response(err: ServerError) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if err.status == 401 else None
        return JSONResponse(err.response().model_dump(), err.status, headers=headers)

    @app.exception_handler(ServerError)
    async def _server_error(_: Request, exc: ServerError) -> JSONResponse:
        return error_response(exc)

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
        if api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        ok = scheme.lower() == "bearer" and hmac.compare_digest(
            token.strip().encode(), api_key.encode()
        )
        if not ok:
            msg = (
                "invalid API key"
                if header
                else "missing API key: send 'Authorization: Bearer <key>'"
            )
            raise ServerError(msg, 401, code="invalid_api_key")

    guarded = [Depends(check_api_key)]

    # -- OpenAI endpoints ---------------------------------------------------------------------
    @app.post("/v1/completions", dependencies=guarded)
    async def completions(request: Request) -> Response:
        data = parse_json_body(await read_body(request, max_body_bytes))
        return await serving.completions(validate_body(CompletionRequest, data), request)

    @app.post("/v1/chat/completions", dependencies=guarded)
    async def chat_completions(request: Request) -> Response:
        data = parse_json_body(await read_body(request, max_body_bytes))
        return await serving.chat(validate_body(ChatCompletionRequest, data), request)

    @app.get("/v1/models", dependencies=guarded)
    async def models() -> JSONResponse:
        cards = [
            ModelCard(id=n, root=client.model_name, max_model_len=client.max_model_len)
            for n in names
        ]
        return JSONResponse(ModelList(data=cards).model_dump())

    # -- operations ---------------------------------------------------------------------------
    @app.get("/health")
    async def health() -> Response:
        if client.alive:
            return Response(status_code=200)
        return error_response(
            ServerError("the engine thread is not running", 503, code="engine_dead")
        )

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(client.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": __version__})

    return app
