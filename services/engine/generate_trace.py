"""The engine's `engine.generate` span: one per Generate call (README
"Tracing"; services/common/tracing.py).

It continues the gateway's `gateway.request` span, whose W3C context the
call's first message carries (`EngineRequest.trace_context` /
`ResumeGeneration.trace_context`; else the call's metadata). Its own
context goes on to vLLM (`GenerationRequest.trace_headers`), whose
`llm_request` span then hangs below it when vLLM exports traces too.

Attributes: `kvmesh.request_id`, `kvmesh.engine`, `kvmesh.priority`,
`kvmesh.prompt_tokens`, `kvmesh.resumed_tokens` (tokens generated on
earlier engines: a migration), `kvmesh.call` (request | resume), and at
the end `gen_ai.usage.input_tokens` / `output_tokens`,
`kvmesh.cached_tokens` (prefix-cache hits), `gen_ai.response.finish_reasons`.
Events: `migrated_in` (a stream continued here after its engine was lost or
it was preempted), `resumed` (a client's resume re-attached to a kept
generation), `first_token` (the prefill is done: the first output with a
token), `decode_end` (the last output).

Off, `start` returns NO_SPAN and `traced` returns the outputs unwrapped: the
per-token path is the same as without tracing.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from services.common.proto.kvmesh.v1 import engine_pb2
from services.common.tracing import NO_SPAN, SERVER, Span, Tracing, trace_carrier
from services.engine.backend import GenerationOutput

__all__ = ["end", "failed", "start", "traced"]


def start(tracing: Tracing, engine_id: str, msg: engine_pb2.EngineRequest | engine_pb2.ResumeGeneration,
          context: grpc.aio.ServicerContext) -> Span:
    """The call's span, continuing the caller's trace (NO_SPAN when off)."""
    if not tracing.enabled:
        return NO_SPAN
    metadata = {k.lower(): v for k, v in (context.invocation_metadata() or ()) if isinstance(v, str)}
    attributes: dict[str, str | int] = {
        "kvmesh.request_id": msg.request_id, "kvmesh.engine": engine_id,
        "kvmesh.prompt_tokens": len(msg.prompt_token_ids)}
    if isinstance(msg, engine_pb2.EngineRequest):
        attributes.update({"kvmesh.call": "request", "kvmesh.priority": msg.priority,
                           "kvmesh.resumed_tokens": msg.resumed_tokens})
    else:
        attributes["kvmesh.call"] = "resume"
    span = tracing.span("engine.generate", remote=trace_carrier(metadata, msg.trace_context), kind=SERVER,
                        attributes=attributes)
    if isinstance(msg, engine_pb2.ResumeGeneration):
        span.event("resumed")
    elif msg.resumed_tokens:
        span.event("migrated_in", {"kvmesh.resumed_tokens": msg.resumed_tokens})
    return span


def failed(span: Span, exc: BaseException) -> None:
    """The call ended by an exception: an abort (a refused request), the
    caller gone (cancelled), or a failure."""
    if span is not NO_SPAN and not isinstance(exc, StopAsyncIteration):
        details = exc.details() if isinstance(exc, grpc.aio.AbortError) and hasattr(exc, "details") else ""
        span.fail(str(details or type(exc).__name__)[:200])


async def traced(outputs: AsyncIterator[GenerationOutput], span: Span) -> AsyncIterator[GenerationOutput]:
    """`outputs`, marking the first token and the end on `span`."""
    first = True
    async for out in outputs:
        if first and out.token_ids:
            first = False
            span.event("first_token")
        if out.finish_reason is not None:
            span.event("decode_end")
            end(span, out)
        yield out


def end(span: Span, final: GenerationOutput) -> None:
    """The generation's outcome on its span (ended by the caller)."""
    if span is NO_SPAN:
        return
    span.set_many({
        "gen_ai.usage.input_tokens": final.prompt_tokens, "gen_ai.usage.output_tokens": final.completion_tokens,
        "kvmesh.cached_tokens": final.cached_tokens,
        "gen_ai.response.finish_reasons": [str(final.finish_reason.value if final.finish_reason else "")]})
    if final.finish_reason is not None and not final.finish_reason.ok:
        span.fail(final.message[:200] or final.finish_reason.value)
