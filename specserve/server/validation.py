"""Reading and validating request bodies: bounded size, bounded nesting, OpenAI-shaped errors.

Bodies are read and parsed here rather than by FastAPI's automatic validation so that every
failure (too large, not JSON, too deep, wrong types) gets our error shape and names the parameter.
"""

from __future__ import annotations

import json
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect, Request

from specserve.server.errors import ServerError, bad_request

M = TypeVar("M", bound=BaseModel)
MAX_JSON_DEPTH = 64  # far beyond any valid body; Python's own parser recurses ~1000 deep
_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none"}


class ClientGone(Exception):
    """The client disconnected before its body arrived: nobody to answer, nothing to log."""


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
    """The body, at most `limit` bytes (413 beyond); ClientGone if the client left mid-upload."""
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            size = int(declared)
        except ValueError:
            raise bad_request("invalid Content-Length header") from None
        if size > limit:
            raise ServerError(f"request body of {size} bytes exceeds the {limit}-byte limit", 413)
    chunks, size = [], 0
    try:
        async for chunk in request.stream():  # also bounds chunked bodies with no Content-Length
            size += len(chunk)
            if size > limit:
                raise ServerError(f"request body exceeds the {limit}-byte limit", 413)
            chunks.append(chunk)
    except ClientDisconnect:
        raise ClientGone() from None
    return b"".join(chunks)


def parse_json_body(body: bytes) -> dict:
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise bad_request(f"request body is not valid JSON: {e}", code="invalid_json") from None
    except RecursionError:
        data = None
    if data is None or _depth_exceeds(data, MAX_JSON_DEPTH):
        raise bad_request(
            f"request body is nested deeper than {MAX_JSON_DEPTH} levels", code="invalid_json"
        )
    if not isinstance(data, dict):
        raise bad_request("request body must be a JSON object", code="invalid_json")
    return data


def _depth_exceeds(data: Any, limit: int) -> bool:
    """Is any container nested more than `limit` deep? Iterative: no recursion to exhaust."""
    stack: list[tuple[Any, int]] = [(data, 1)] if isinstance(data, (dict, list)) else []
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            return True
        for child in node.values() if isinstance(node, dict) else node:
            if isinstance(child, (dict, list)):
                stack.append((child, depth + 1))
    return False
