"""The OpenAI surface's error vocabulary: what a client can be refused with,
as a closed `ErrorKind`, and how that reads over HTTP (status + OpenAI error
JSON). Both OpenAI front doors raise `ApiError`; each turns it into a response
at its one HTTP boundary with `http_error`. The gateway's gRPC mapping and
its upstream mappings live in services/gateway/errors.py.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from aiohttp import web

__all__ = [
    "ApiError",
    "ErrorKind",
    "HttpError",
    "error_body",
    "error_response",
    "http_error",
    "http_status_of",
    "openai_type_of",
]


class ErrorKind(enum.Enum):
    """Closed set of outcomes a client can be refused with; also a metric label."""

    INVALID_REQUEST = "invalid_request"
    BODY_TOO_LARGE = "body_too_large"
    UNAUTHENTICATED = "unauthenticated"
    PERMISSION_DENIED = "permission_denied"
    NOT_FOUND = "not_found"
    RATE_LIMITED = "rate_limited"        # this key's token bucket
    OVERLOADED = "overloaded"            # the scheduler's queues are full
    UNAVAILABLE = "unavailable"          # no engine / scheduler unreachable / draining
    CONFLICT = "conflict"                # request id already running
    TIMEOUT = "timeout"                  # max generation time ran out
    GENERATION_FAILED = "generation_failed"
    INTERNAL = "internal"


# kind -> (HTTP status, OpenAI error type). OpenAI's own types where OpenAI has one.
_HTTP: dict[ErrorKind, tuple[int, str]] = {
    ErrorKind.INVALID_REQUEST: (400, "invalid_request_error"),
    ErrorKind.BODY_TOO_LARGE: (413, "invalid_request_error"),
    ErrorKind.UNAUTHENTICATED: (401, "authentication_error"),
    ErrorKind.PERMISSION_DENIED: (403, "permission_error"),
    ErrorKind.NOT_FOUND: (404, "invalid_request_error"),
    ErrorKind.RATE_LIMITED: (429, "rate_limit_error"),
    ErrorKind.OVERLOADED: (429, "rate_limit_error"),
    ErrorKind.UNAVAILABLE: (503, "service_unavailable_error"),
    ErrorKind.CONFLICT: (409, "invalid_request_error"),
    ErrorKind.TIMEOUT: (504, "timeout_error"),
    ErrorKind.GENERATION_FAILED: (502, "server_error"),
    ErrorKind.INTERNAL: (500, "server_error"),
}


class ApiError(Exception):
    """A request-level failure with a message that says what to change."""

    def __init__(
        self,
        kind: ErrorKind,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        retry_after: float | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.param = param
        self.code = code
        self.retry_after = retry_after
        self.headers = dict(headers or {})

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.kind.value}, {self.message!r})"


@dataclass(frozen=True)
class HttpError:
    status: int
    body: dict[str, object]
    headers: dict[str, str]


def http_status_of(kind: ErrorKind) -> int:
    return _HTTP[kind][0]


def openai_type_of(kind: ErrorKind) -> str:
    return _HTTP[kind][1]


def error_body(exc: ApiError) -> dict[str, object]:
    """OpenAI's error JSON: {"error": {message, type, param, code}}."""
    return {
        "error": {
            "message": exc.message,
            "type": openai_type_of(exc.kind),
            "param": exc.param,
            "code": exc.code or exc.kind.value,
        }
    }


def http_error(exc: ApiError) -> HttpError:
    """Status, OpenAI error JSON and headers (Retry-After in whole seconds)."""
    headers = dict(exc.headers)
    if exc.retry_after is not None:
        headers["Retry-After"] = str(max(1, math.ceil(exc.retry_after)))
    return HttpError(http_status_of(exc.kind), error_body(exc), headers)


def error_response(exc: ApiError, headers: dict[str, str] | None = None) -> web.Response:
    """`http_error` as an aiohttp response, with extra headers (a request id)."""
    mapped = http_error(exc)
    return web.json_response(mapped.body, status=mapped.status, headers={**mapped.headers, **(headers or {})})
