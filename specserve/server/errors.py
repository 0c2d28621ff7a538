"""OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}` with the right status.

Every failure a client can cause maps to a 4xx here; only a bug of ours becomes a 500, and then
only for the one request that hit it.
"""

from __future__ import annotations

from http import HTTPStatus

from pydantic import BaseModel


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


# OpenAI's error `type` strings, by status
_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    500: "internal_server_error",
    503: "service_unavailable",
}


class ServerError(Exception):
    """Raised anywhere in a request handler; the app turns it into an ErrorResponse."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "invalid_request_error")

    def response(self) -> ErrorResponse:
        return ErrorResponse(
            error=ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)
        )


def error_body(
    message: str, status: int, param: str | None = None, code: str | None = None
) -> ErrorResponse:
    return ServerError(message, status, param, code).response()


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ServerError:
    return ServerError(message, 400, param, code)


def internal_error(exc: BaseException) -> ServerError:
    # the exception text helps whoever reads the client log; the traceback stays in the server log
    name = type(exc).__name__
    return ServerError(f"internal error: {name}: {exc}", 500, code="internal_error")


def status_phrase(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "error"
