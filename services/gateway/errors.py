"""The gateway's error vocabulary and its ONE mapping boundary per transport.

Everything the gateway can refuse or fail with is a `GatewayError` carrying a
closed `ErrorKind` — the OpenAI surface's own error vocabulary
(services/common/openai_api/errors.py, shared with the engine's HTTP
endpoint), under the gateway's name. This module alone decides:

- upstream gRPC status / scheduler rejections -> domain errors
  (`from_scheduler_rpc_error`, `from_rejection`, `classify_engine_rpc_error`),
- domain errors -> HTTP status + OpenAI error JSON + headers (`http_error`,
  the OpenAI surface's mapping),
- domain errors -> gRPC status code + message + trailing metadata (`grpc_status`),
- a generation's finish reason -> the client's error (`finish_error`): every
  transport (SSE, JSON, gRPC status, Responses events, batch lines) and the
  driver (a failure before any token) ask it.

"Engine failed" (`EngineFailure`: the engine died or dropped the stream, so
the request migrates elsewhere) is deliberately NOT a `GatewayError`: it never
reaches a client as such. Only when migrations run out does the driver turn
it into `GenerationFailed`. Nor is `EngineStopped`: the gateway stopped the
engine stream itself because the scheduler preempted the request, which then
continues elsewhere -- no engine failed.
"""

from __future__ import annotations

import math

import grpc

from services.common.finish_reason import FinishReason
from services.common.openai_api.errors import ApiError, ErrorKind, HttpError, http_error, http_status_of
from services.common.proto.kvmesh.v1 import scheduler_pb2

__all__ = [
    "EngineFailure",
    "EngineStopped",
    "ErrorKind",
    "GatewayError",
    "HttpError",
    "classify_engine_rpc_error",
    "finish_error",
    "from_rejection",
    "from_scheduler_rpc_error",
    "grpc_status",
    "http_error",
    "http_status_of",
    "resume_not_found",
]

# The gateway's request-level failure is the OpenAI surface's: the parsing
# and tokenizing it shares with the engine's endpoint raise it directly.
GatewayError = ApiError

# kind -> gRPC status code (the HTTP side is the OpenAI surface's table).
_GRPC_CODES: dict[ErrorKind, grpc.StatusCode] = {
    ErrorKind.INVALID_REQUEST: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorKind.BODY_TOO_LARGE: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorKind.UNAUTHENTICATED: grpc.StatusCode.UNAUTHENTICATED,
    ErrorKind.PERMISSION_DENIED: grpc.StatusCode.PERMISSION_DENIED,
    ErrorKind.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    ErrorKind.RATE_LIMITED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ErrorKind.OVERLOADED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ErrorKind.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    ErrorKind.CONFLICT: grpc.StatusCode.ALREADY_EXISTS,
    ErrorKind.TIMEOUT: grpc.StatusCode.DEADLINE_EXCEEDED,
    ErrorKind.GENERATION_FAILED: grpc.StatusCode.INTERNAL,
    ErrorKind.INTERNAL: grpc.StatusCode.INTERNAL,
}


class EngineFailure(Exception):
    """The engine (not the request) failed: the stream may migrate elsewhere."""

    def __init__(self, engine_id: str, message: str) -> None:
        super().__init__(message)
        self.engine_id = engine_id
        self.message = message


class EngineStopped(Exception):
    """The gateway stopped the engine stream itself (`EngineStream.stop`: the
    request was preempted). Neither the engine nor the request failed."""

    def __init__(self, engine_id: str) -> None:
        super().__init__(f"engine {engine_id}: stream stopped by the gateway (preempted)")
        self.engine_id = engine_id


# ------------------------------------------------------------ upstream -> domain

_REJECT_KINDS: dict[int, ErrorKind] = {
    scheduler_pb2.REJECT_CODE_QUEUE_FULL: ErrorKind.OVERLOADED,
    scheduler_pb2.REJECT_CODE_TENANT_FULL: ErrorKind.OVERLOADED,
    scheduler_pb2.REJECT_CODE_EXPIRED: ErrorKind.UNAVAILABLE,
    scheduler_pb2.REJECT_CODE_NO_ENGINE: ErrorKind.UNAVAILABLE,
    scheduler_pb2.REJECT_CODE_DRAINING: ErrorKind.UNAVAILABLE,
    scheduler_pb2.REJECT_CODE_TOO_LARGE: ErrorKind.INVALID_REQUEST,
    scheduler_pb2.REJECT_CODE_INVALID: ErrorKind.INVALID_REQUEST,
}

_REJECT_ADVICE: dict[int, str] = {
    scheduler_pb2.REJECT_CODE_QUEUE_FULL: "the queue for this priority is full; retry later or use a lower priority",
    scheduler_pb2.REJECT_CODE_TENANT_FULL: "your tenant has too many queued requests; wait for some to finish",
    scheduler_pb2.REJECT_CODE_EXPIRED: "the request waited in the queue past its deadline; retry later",
    scheduler_pb2.REJECT_CODE_NO_ENGINE: "no engine is serving this model right now; retry later",
    scheduler_pb2.REJECT_CODE_DRAINING: "the scheduler is shutting down; retry shortly",
    scheduler_pb2.REJECT_CODE_TOO_LARGE: "the request fits on no engine; shorten the prompt or lower max_tokens",
    scheduler_pb2.REJECT_CODE_INVALID: "the scheduler refused the request as malformed",
}


def resume_not_found() -> GatewayError:
    """A resume of a stream that is not there to continue -- unknown,
    finished, expired, or another tenant's: all one 404 (a 403 for another
    tenant's id would tell a prober which ids exist)."""
    return GatewayError(
        ErrorKind.NOT_FOUND,
        "no stream to resume under this Last-Event-ID: it finished, its resume grace ran out, or it was "
        "started with another API key; send the request again without Last-Event-ID",
        code="resume_not_found",
    )


_RESUME_REFUSED = (scheduler_pb2.REJECT_CODE_RESUME_UNKNOWN, scheduler_pb2.REJECT_CODE_RESUME_FORBIDDEN)


def from_rejection(rejected: scheduler_pb2.Rejected) -> GatewayError:
    """The scheduler's `Rejected` -> the client-facing error."""
    if rejected.code in _RESUME_REFUSED:
        return resume_not_found()
    kind = _REJECT_KINDS.get(rejected.code, ErrorKind.UNAVAILABLE)
    advice = _REJECT_ADVICE.get(rejected.code, "the scheduler rejected the request")
    name = scheduler_pb2.RejectCode.Name(rejected.code) if rejected.code in _REJECT_KINDS else str(rejected.code)
    message = f"{advice} ({name.removeprefix('REJECT_CODE_').lower()}"
    message += f": {rejected.message})" if rejected.message else ")"
    retry_after = rejected.retry_after_seconds or None
    if retry_after is None and kind in (ErrorKind.OVERLOADED, ErrorKind.UNAVAILABLE):
        retry_after = 1.0
    return GatewayError(kind, message, code=name.lower(), retry_after=retry_after)


def from_scheduler_rpc_error(err: grpc.RpcError | None) -> GatewayError:
    """The Admit stream failed or ended without an answer."""
    detail = f"{err.code().name}: {err.details()}" if isinstance(err, grpc.aio.AioRpcError) else "stream ended"
    return GatewayError(
        ErrorKind.UNAVAILABLE,
        f"the scheduler is unreachable ({detail}); retry shortly",
        code="scheduler_unavailable",
        retry_after=1.0,
    )


# Engine status codes that mean "this request is wrong", not "this engine is
# broken"; everything else (UNAVAILABLE, INTERNAL, CANCELLED by the server,
# RESOURCE_EXHAUSTED, a stream ended early...) migrates the request.
_REQUEST_FAULTS = {
    grpc.StatusCode.INVALID_ARGUMENT: ErrorKind.INVALID_REQUEST,
    grpc.StatusCode.OUT_OF_RANGE: ErrorKind.INVALID_REQUEST,
    grpc.StatusCode.ALREADY_EXISTS: ErrorKind.CONFLICT,
    grpc.StatusCode.NOT_FOUND: ErrorKind.NOT_FOUND,   # a resume of a generation the engine no longer has
    grpc.StatusCode.ABORTED: ErrorKind.CONFLICT,      # taken over by a resume on another call
}


def classify_engine_rpc_error(err: grpc.aio.AioRpcError, engine_id: str) -> GatewayError | EngineFailure:
    kind = _REQUEST_FAULTS.get(err.code())
    if err.code() == grpc.StatusCode.ABORTED:  # a resume took the stream over elsewhere
        return GatewayError(ErrorKind.CONFLICT, "this stream was resumed on another connection",
                            code="stream_resumed")
    if kind is ErrorKind.CONFLICT:
        return GatewayError(
            kind,
            f"request id is already running on engine {engine_id}; send a unique x-request-id",
            code="duplicate_request_id",
        )
    if kind is ErrorKind.NOT_FOUND:  # only a resume asks for a generation by id
        return resume_not_found()
    if kind is not None:
        return GatewayError(kind, f"the engine refused the request: {err.details()}")
    return EngineFailure(engine_id, f"engine {engine_id}: {err.code().name}: {err.details()}")


# ------------------------------------------------------------ finish -> domain


def finish_error(
    reason: FinishReason, message: str = "", kind: ErrorKind = ErrorKind.GENERATION_FAILED,
) -> GatewayError | None:
    """The client's error for a generation that ended with `reason`; None
    when it succeeded (stop, length). A timeout is always TIMEOUT; any other
    failure is `kind` (the driver passes UNAVAILABLE when migrations ran
    out). The error's code is the finish reason itself."""
    if reason.ok:
        return None
    if reason is FinishReason.TIMEOUT:
        kind = ErrorKind.TIMEOUT
    return GatewayError(kind, message or f"the generation ended with {reason.value}", code=reason.value)


# ------------------------------------------------------------ domain -> gRPC


def grpc_status(exc: GatewayError) -> tuple[grpc.StatusCode, str, tuple[tuple[str, str], ...]]:
    """(code, details, trailing metadata) for aborting an Inference call."""
    message = exc.message if exc.param is None else f"{exc.param}: {exc.message}"
    trailers: tuple[tuple[str, str], ...] = ()
    if exc.retry_after is not None:
        trailers = (("retry-after", str(max(1, math.ceil(exc.retry_after)))),)
    return _GRPC_CODES[exc.kind], message, trailers


class SchedulerRestarting(GatewayError):
    """`from_scheduler_rpc_error`'s error from a scheduler that answered this
    gateway before: a restart to wait out (re-admit, re-attach), not a
    misconfiguration to report at once. A client that still gets it sees the
    same status, code and message as for any unreachable scheduler."""

    @classmethod
    def of(cls, unreachable: GatewayError) -> SchedulerRestarting:
        return cls(
            unreachable.kind, unreachable.message, param=unreachable.param, code=unreachable.code,
            retry_after=unreachable.retry_after, headers=unreachable.headers,
        )
