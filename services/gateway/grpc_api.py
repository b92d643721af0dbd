"""The public gRPC API: `kvmesh.v1.Inference` (Chat, Generate, ListModels,
Tokenize, Detokenize).

Chat and Generate decode the message into a `GenerationInput`, run it
through the one request pipeline (pipeline.py) and write its events as
`GenerateEvent`s.

Error boundary: handlers raise `GatewayError`; `_abort` is the one place that
turns it into a gRPC status (through `errors.grpc_status`). Errors before the
first token end the call with a status; after it, the stream ends with a
`finished` event carrying ERROR / TIMEOUT.

Handlers are coroutines that `await context.write(...)` (not async
generators), so a client cancel or an expired deadline lands as
CancelledError inside the handler's own try/finally, which cancels the
request's Admit and Generate calls at once.

Resume (README "Resuming a stream"): each `delta` event carries `index`; a
request re-sent with `resume` {request_id, last_index} (same body, same key)
continues that stream after event `last_index` -- the same rules and errors
as the HTTP API's Last-Event-ID.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn, cast

import grpc

from services.common.openai_api.requests import GenerationInput
from services.common.proto.kvmesh.v1 import common_pb2, inference_pb2, inference_pb2_grpc
from services.common.tool_calling.grpc_mapping import ToolEventMapper
from services.gateway.errors import GatewayError, grpc_status
from services.gateway.events import Event, Finished, Heartbeat, QueuedUpdate, TextDelta
from services.gateway.jobs import parse_last_event_id, request_id_from
from services.gateway.keys import api_key_from_headers
from services.gateway.metrics import error_label
from services.gateway.pipeline import ResumePoint, Traced
from services.gateway.transport_parts import TransportParts
from services.gateway.validation import (
    chat_from_proto,
    generate_from_proto,
    priority_from_proto,
    priority_to_proto,
)

__all__ = ["InferenceApi", "event_to_proto"]


def event_to_proto(request_id: str, event: Event) -> inference_pb2.GenerateEvent:
    if isinstance(event, TextDelta):
        return inference_pb2.GenerateEvent(
            request_id=request_id,
            delta=inference_pb2.DeltaEvent(text=event.text, token_ids=event.token_ids, logprobs=event.logprobs,
                                           choice_index=event.choice),
            index=event.index,
        )
    if isinstance(event, QueuedUpdate):
        return inference_pb2.GenerateEvent(
            request_id=request_id,
            queued=inference_pb2.QueuedEvent(
                position=event.position,
                estimated_wait_seconds=event.estimated_wait_seconds,
                # priority_to_proto returns one of the Priority values, typed int.
                priority=cast(inference_pb2.Priority, priority_to_proto(event.priority)),
            ),
        )
    if isinstance(event, Finished):
        return inference_pb2.GenerateEvent(
            request_id=request_id,
            finished=inference_pb2.FinishedEvent(
                finish_reason=event.reason.to_proto(),
                usage=common_pb2.Usage(
                    prompt_tokens=event.usage.prompt_tokens,
                    completion_tokens=event.usage.completion_tokens,
                    cached_tokens=event.usage.cached_tokens,
                ),
                message=event.message,
                choice_index=event.choice,
            ),
        )
    return inference_pb2.GenerateEvent(request_id=request_id, heartbeat=inference_pb2.HeartbeatEvent())


def _metadata(context: grpc.aio.ServicerContext) -> dict[str, str]:
    return {k.lower(): v for k, v in (context.invocation_metadata() or ()) if isinstance(v, str)}


class InferenceApi(inference_pb2_grpc.InferenceServicer):
    def __init__(self, parts: TransportParts) -> None:
        self._parts = parts

    async def _abort(self, context: grpc.aio.ServicerContext, route: str, exc: GatewayError) -> NoReturn:
        code, message, trailers = grpc_status(exc)
        self._parts.metrics.child(self._parts.metrics.requests, route, code.name).inc()
        self._parts.metrics.rejected(error_label(exc.code, exc.kind.value))
        await context.abort(code, message, trailing_metadata=trailers)
        raise AssertionError("unreachable")  # context.abort always raises

    async def Chat(self, request: inference_pb2.ChatRequest, context: grpc.aio.ServicerContext) -> None:
        await self._serve("grpc.Chat", chat_from_proto, request, context)

    async def Generate(self, request: inference_pb2.GenerateRequest, context: grpc.aio.ServicerContext) -> None:
        await self._serve("grpc.Generate", generate_from_proto, request, context)

    async def _serve(
        self,
        route: str,
        parse: Callable[[Any], GenerationInput],
        request: Any,
        context: grpc.aio.ServicerContext,
    ) -> None:
        metadata = _metadata(context)
        try:
            async with self._parts.pipeline.traced(metadata, route, grpc=True) as traced:
                await self._serve_traced(parse, request, context, metadata, traced)
        except GatewayError as exc:
            await self._abort(context, route, exc)
        self._parts.metrics.child(self._parts.metrics.requests, route, "OK").inc()

    async def _serve_traced(
        self, parse: Callable[[Any], GenerationInput], request: Any,
        context: grpc.aio.ServicerContext, metadata: dict[str, str], traced: Traced,
    ) -> None:
        """Decode the message, run it through the pipeline, write its events;
        errors raise GatewayError (`_serve` aborts with it)."""
        resume = request.resume if request.HasField("resume") else None
        request_id = resume.request_id if resume else request_id_from(
            metadata.get("x-request-id"), metadata.get("x-envoy-attempt-count"))
        traced.identify(request_id)
        if resume is not None:
            parse_last_event_id(f"{resume.request_id}.0")  # the same id rules as the HTTP API
        principal = self._parts.pipeline.authenticate(api_key_from_headers(metadata))
        generation = parse(request)
        priority = priority_from_proto(request.priority)
        remaining = context.time_remaining()
        if remaining is not None:
            # The client's deadline bounds the generation too.
            current = generation.max_generation_seconds
            generation.max_generation_seconds = remaining if current is None else min(current, remaining)
        point = ResumePoint(resume.last_index, "resume") if resume is not None else None
        async with await self._parts.pipeline.open(
                traced.request(request_id, generation, principal, priority, point, metadata)) as run:
            await context.send_initial_metadata(
                (("x-request-id", request_id), *((k.lower(), v) for k, v in run.cache_headers.items())))
            # Tool calls parsed out of the text (services/gateway/tool_grpc.py).
            tools = ToolEventMapper(request_id, run.tool_parser) if run.tool_parser is not None else None
            async for event in run:
                message = event_to_proto(request_id, event)
                for out in tools.map(event, message) if tools is not None else (message,):
                    await context.write(out)
                if not isinstance(event, Heartbeat):
                    run.mark_output()

    async def ListModels(
        self, request: inference_pb2.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.ListModelsResponse:
        try:
            principal = self._parts.frontdoor.authenticate(api_key_from_headers(_metadata(context)))
        except GatewayError as exc:
            await self._abort(context, "grpc.ListModels", exc)
        listed = await self._parts.frontdoor.listed_models(principal, self._parts.served)
        cards = [inference_pb2.ModelCard(id=name, max_model_len=length, engines=engines)
                 for name, length, engines in listed]
        self._parts.metrics.requests.labels("grpc.ListModels", "OK").inc()
        return inference_pb2.ListModelsResponse(models=cards)

    async def Tokenize(
        self, request: inference_pb2.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.TokenizeResponse:
        body: dict[str, Any] = {"model": request.model or None}
        if request.messages:
            body["messages"] = [{"role": m.role, "content": m.content} for m in request.messages]
        else:
            body["prompt"] = request.prompt
        for name in ("add_special_tokens", "add_generation_prompt"):
            if request.HasField(name):
                body[name] = getattr(request, name)
        try:
            principal = self._parts.frontdoor.authenticate(api_key_from_headers(_metadata(context)))
            out = self._parts.tokenize.tokenize(principal, body)
        except GatewayError as exc:
            await self._abort(context, "grpc.Tokenize", exc)
        self._parts.metrics.requests.labels("grpc.Tokenize", "OK").inc()
        return inference_pb2.TokenizeResponse(tokens=out["tokens"], count=out["count"],
                                              max_model_len=out["max_model_len"])

    async def Detokenize(
        self, request: inference_pb2.DetokenizeRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.DetokenizeResponse:
        try:
            principal = self._parts.frontdoor.authenticate(api_key_from_headers(_metadata(context)))
            out = self._parts.tokenize.detokenize(
                principal, {"model": request.model or None, "tokens": list(request.tokens)})
        except GatewayError as exc:
            await self._abort(context, "grpc.Detokenize", exc)
        self._parts.metrics.requests.labels("grpc.Detokenize", "OK").inc()
        return inference_pb2.DetokenizeResponse(prompt=out["prompt"])
