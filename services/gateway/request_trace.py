"""The gateway's `gateway.request` span: one per generation request, for
both transports (README "Tracing"; services/common/tracing.py).

It continues the caller's trace (Envoy's span, or a client's own
`traceparent`) and is the parent of the scheduler's `scheduler.admit` and
the engines' `engine.generate` spans: its context rides in each Admit and
Generate request (`Job.trace_context`). The request's own events land on
it: `first_token`, `migration` (an engine lost, the stream moves on),
`preempted` and `resumed` (a higher class took the slot, the request
continued later).

Attributes: `kvmesh.route`, `kvmesh.request_id` (the id clients see as
x-request-id and in every service's log lines), `kvmesh.tenant`,
`kvmesh.priority`, the GenAI semantic conventions (`gen_ai.operation.name`,
`gen_ai.system`, `gen_ai.request.model`, `gen_ai.request.max_tokens`,
`gen_ai.usage.input_tokens` / `output_tokens`,
`gen_ai.response.finish_reasons`), and the outcome: `kvmesh.status` ("ok"
or the error code), `http.response.status_code` or `rpc.grpc.status_code`.

With tracing off every function here gets `NO_SPAN` and does nothing.
"""

from __future__ import annotations

from collections.abc import Mapping

from services.common.openai_api.errors import http_status_of
from services.common.tracing import NO_SPAN, SERVER, Span, Tracing
from services.gateway.errors import GatewayError, grpc_status
from services.gateway.jobs import Job

__all__ = ["admitted", "failed", "finished", "start"]

# Route -> gen_ai.operation.name (GenAI semantic conventions).
_OPERATIONS = {"chat": "chat", "completion": "text_completion", "responses": "chat", "grpc.Chat": "chat",
               "grpc.Generate": "text_completion"}


def start(tracing: Tracing, headers: Mapping[str, str], route: str) -> Span:
    """The request's span, continuing `headers`' traceparent if any."""
    if not tracing.enabled:
        return tracing.span("gateway.request")  # NO_SPAN: nothing read, nothing built
    return tracing.span("gateway.request", remote=headers, kind=SERVER, attributes={
        "kvmesh.route": route, "gen_ai.operation.name": _OPERATIONS.get(route, route),
        "gen_ai.system": "kvmesh"})


def admitted(span: Span, job: Job) -> None:
    """The front door built the job: link it to the span (its context goes
    to the scheduler and engines with it) and describe the request."""
    if span is NO_SPAN:
        return  # tracing off
    job.trace = span
    job.trace_context = tuple(span.carrier().items())
    span.set_many({
        "kvmesh.request_id": job.request_id, "kvmesh.tenant": job.tenant, "kvmesh.priority": job.priority,
        "gen_ai.request.model": job.model, "gen_ai.request.max_tokens": job.max_tokens,
        "gen_ai.usage.input_tokens": len(job.prompt_ids), "kvmesh.n": job.n,
        "kvmesh.resume": job.resume_from is not None,
    })


def finished(span: Span, output_tokens: int | None, status: int | str, grpc: bool = False,
             outcome: str = "ok") -> None:
    """The request ended (its last event went out, or an error status);
    `output_tokens` None: set on the span already."""
    span.set("kvmesh.status", outcome)
    if output_tokens is not None:
        span.set("gen_ai.usage.output_tokens", output_tokens)
    span.set("rpc.grpc.status_code" if grpc else "http.response.status_code", status)
    span.end()


def failed(span: Span, exc: BaseException, output_tokens: int | None = 0, grpc: bool = False) -> None:
    """The request ended with an error: `GatewayError` (the client's status),
    or anything else (cancelled: the client left)."""
    if span is NO_SPAN:
        return
    status: int | str
    if isinstance(exc, GatewayError):
        outcome = exc.code or exc.kind.value
        span.fail(exc.message[:200])
        status = grpc_status(exc)[0].value[0] if grpc else http_status_of(exc.kind)
    else:
        outcome = "internal" if isinstance(exc, Exception) else "cancelled"
        span.fail(type(exc).__name__)
        status = 1 if grpc else 499  # CANCELLED / client closed request
    finished(span, output_tokens, status, grpc, outcome)
