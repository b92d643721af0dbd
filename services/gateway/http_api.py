"""The OpenAI-compatible HTTP API (aiohttp).

Chat and completions decode the body into a `GenerationInput`, run it
through the one request pipeline (pipeline.py) and render its events as
OpenAI chunks (SSE, via sse_relay.py) or one JSON body.

Error boundary: handlers raise `GatewayError`; `_error_middleware` is the one
place that turns it (and aiohttp's own 404/405/413) into OpenAI error JSON via
`errors.http_error`. Once an SSE response has started, a failure is sent as an
SSE `{"error": ...}` event followed by `data: [DONE]`.

Resume (README "Resuming a stream"): the role chunk of a streamed response
carries `id: <request_id>.0` and every text chunk `id: <request_id>.<n>`
(`TextDelta.index`); the final chunks carry none (an SSE client keeps the
last). A request with `Last-Event-ID` -- the same body, the same key -- is a
resume of that stream: same request id, no role chunk, the next text chunk
first.

An SSE response starts lazily (sse_relay.py): at the first token, or at the
first heartbeat while queued. So a request the scheduler rejects quickly
still gets a real 429/503 status, while a long wait in the queue keeps the
connection alive.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from services.common.clock import SystemClock
from services.common.config import MeshConfig
from services.common.openai_api.completions_output import (
    SSE_DONE,
    ChatFormatter,
    CompletionFormatter,
    Formatter,
    sse,
)
from services.common.openai_api.errors import error_response
from services.common.openai_api.requests import (
    GenerationInput,
    parse_chat_body,
    parse_completion_body,
    parse_json_body,
)
from services.common.proto.kvmesh.v1 import common_pb2
from services.common.tool_calling.chat_output import ToolChatFormatter
from services.gateway.batch_lines import BATCH_PRIORITY, BatchLines, LineTiming
from services.gateway.errors import ErrorKind, GatewayError, finish_error, http_error
from services.gateway.events import Event, Finished, TextDelta
from services.gateway.jobs import parse_last_event_id, request_id_from
from services.gateway.keys import api_key_from_headers
from services.gateway.metrics import error_label
from services.gateway.openapi import openapi_document
from services.gateway.pipeline import Generation, ResumePoint, Traced
from services.gateway.responses_api import ResponsesApi
from services.gateway.responses_store import ResponsesStore, build_responses_store
from services.gateway.sse_relay import relay_sse
from services.gateway.transport_parts import TransportParts
from services.gateway.validation import parse_priority_header

__all__ = ["HttpApi"]

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

_REQUEST_ID = web.RequestKey("request_id", str)



def _error_response(exc: GatewayError, request_id: str | None) -> web.Response:
    return error_response(exc, {"x-request-id": request_id} if request_id else None)


def _event_id(sse_id: bytes, index: int) -> bytes:
    """`id: <request_id>.<index>` before a chunk; nothing for a stream that
    cannot be resumed (sse_id empty)."""
    return b"%s%d\n" % (sse_id, index) if sse_id else b""


def _formatter(route: str, generation: GenerationInput, request_id: str, run: Generation) -> Formatter:
    """How this request's events become OpenAI chunks: with tool calls
    parsed out of the text (tool_output.py), or plain chat / completion."""
    if run.tool_parser is not None:
        return ToolChatFormatter(request_id, generation.model, generation.include_usage, run.tool_parser)
    formatter_cls = ChatFormatter if route == "chat" else CompletionFormatter
    return formatter_cls(request_id, generation.model, generation.include_usage)


class HttpApi:
    def __init__(self, config: MeshConfig, parts: TransportParts,
                 responses_store: ResponsesStore | None = None) -> None:
        self._config = config
        self._parts = parts
        self.responses_store = responses_store or build_responses_store(config, SystemClock())
        # Lines of the batch service (batch_lines.py): only with its internal credential.
        self._batch_lines = BatchLines(config, parts.pipeline.frontdoor.keys)

    async def _close_responses_store(self, _app: web.Application) -> None:
        await self.responses_store.aclose()

    def app(self) -> web.Application:
        """The routes (the Files + Batches API is the batch service's, services/batch/)."""
        app = web.Application(
            middlewares=[self._error_middleware],
            client_max_size=self._config.gateway.max_body_bytes,
        )
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/completions", self.completions)
        ResponsesApi(self._parts.pipeline, self.responses_store, self._read_json, _REQUEST_ID).register(app)
        app.on_cleanup.append(self._close_responses_store)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model}", self.model)
        app.router.add_post("/tokenize", self._tokenize_route)
        app.router.add_post("/detokenize", self._detokenize_route)
        app.router.add_get("/health", self.health)
        app.router.add_get("/openapi.json", self.openapi)
        return app

    # ---------------------------------------------------------------- boundary

    @web.middleware
    async def _error_middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        route = request.match_info.route.resource.canonical if request.match_info.route.resource else "unmatched"
        status = 500
        try:
            response = await handler(request)
            status = response.status
            return response
        except GatewayError as exc:
            self._parts.metrics.rejected(error_label(exc.code, exc.kind.value))
            response = _error_response(exc, request.get(_REQUEST_ID))
            status = response.status
            return response
        except web.HTTPRequestEntityTooLarge:
            self._parts.metrics.rejected("request_too_large")
            response = _error_response(
                GatewayError(
                    ErrorKind.BODY_TOO_LARGE,
                    f"the request body is larger than {self._config.gateway.max_body_bytes} bytes; send a smaller one",
                    code="request_too_large",
                ),
                request.get(_REQUEST_ID),
            )
            status = 413
            return response
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            kind = ErrorKind.NOT_FOUND if exc.status == 404 else ErrorKind.INVALID_REQUEST
            message = f"{request.method} {request.path}: {exc.reason}"
            if exc.status == 404:
                message = f"no route {request.path}; see GET /openapi.json"
            self._parts.metrics.rejected(kind.value)
            response = _error_response(GatewayError(kind, message), None)
            response.set_status(exc.status)
            status = exc.status
            return response
        finally:
            metrics = self._parts.metrics
            metrics.child(metrics.requests, route, str(status)).inc()

    async def _read_json(self, request: web.Request) -> Any:
        limit = self._config.gateway.max_body_bytes
        if request.content_length is not None and request.content_length > limit:
            raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=request.content_length)
        return parse_json_body(await request.read())

    # ---------------------------------------------------------------- generation

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "chat")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "completion")

    async def _generate(self, request: web.Request, route: str) -> web.StreamResponse:
        async with self._parts.pipeline.traced(request.headers, route) as traced:
            response = await self._generate_traced(request, route, traced)
            traced.status = response.status
        return response

    async def _generate_traced(self, request: web.Request, route: str, traced: Traced) -> web.StreamResponse:
        """Decode the body, run it through the pipeline, render its events."""
        resume = parse_last_event_id(request.headers.get("last-event-id"))
        line = self._batch_lines.read(request.headers)   # None unless the batch service sent it
        request_id = line.request_id if line else resume[0] if resume else request_id_from(
            request.headers.get("x-request-id"), request.headers.get("x-envoy-attempt-count"))
        request[_REQUEST_ID] = request_id
        traced.identify(request_id)
        principal = line.principal if line else self._parts.pipeline.authenticate(
            api_key_from_headers(request.headers))
        body = await self._read_json(request)
        generation = parse_chat_body(body) if route == "chat" else parse_completion_body(body)
        priority = BATCH_PRIORITY if line else parse_priority_header(request.headers.get("x-priority"))
        if resume and not generation.stream:
            raise GatewayError(ErrorKind.INVALID_REQUEST, "Last-Event-ID resumes a streamed response; "
                               "set \"stream\": true", param="Last-Event-ID")
        point = ResumePoint(resume[1], "Last-Event-ID") if resume else None
        # Batch lines skip the response cache (cache headers None), as they always have.
        async with await self._parts.pipeline.open(traced.request(
                request_id, generation, principal, priority, point, None if line else request.headers,
                batch=line)) as run:
            formatter = _formatter(route, generation, request_id, run)
            if generation.stream:
                return await self._stream(request, run, formatter, resume is not None, generation.n)
            if line is None:
                return await self._collect(run, formatter)
            # A batch line's answer also tells its timing (batch_lines.py).
            timing = LineTiming(self._parts.pipeline.clock)
            response = await self._collect(run, formatter, timing.see)
            response.headers.update(timing.headers())
            return response

    async def _stream(
        self, request: web.Request, stream: Generation, formatter: Formatter, resumed: bool, n: int = 1,
    ) -> web.StreamResponse:
        # Event ids (resume points) only where a stream can be resumed: one
        # choice, no tool calls held back.
        sse_id = (f"id: {request[_REQUEST_ID]}.".encode() if n == 1 and formatter.resumable and stream.resumable
                  else b"")

        def render(event: Event) -> bytes | None:
            if isinstance(event, TextDelta):
                # Nothing when the formatter has none to send yet (a tool call held back).
                chunk = formatter.delta_sse(event.text, event.logprobs, index=event.choice)
                return _event_id(sse_id, event.index) + chunk if chunk else b""
            if isinstance(event, Finished):
                return self._final_bytes(formatter, event)
            return None   # QueuedUpdate: OpenAI's stream has no place for it (heartbeats cover it).

        opening = b"" if resumed else self._first_bytes(formatter, n, sse_id)
        return await relay_sse(request, stream, opening, render, lambda exc: sse(http_error(exc).body) + SSE_DONE)

    @staticmethod
    def _first_bytes(formatter: Formatter, n: int, sse_id: bytes) -> bytes:
        """The role chunk (chat), one per choice; with one choice, event 0."""
        if formatter.first_chunk() is None:
            return b""
        if n == 1:
            return _event_id(sse_id, 0) + sse(formatter.first_chunk() or {})
        return b"".join(sse(formatter.first_chunk(i) or {}) for i in range(n))

    @staticmethod
    def _final_bytes(formatter: Formatter, finished: Finished) -> bytes:
        error = finish_error(finished.reason, finished.message)
        if error is not None:
            return sse(http_error(error).body) + SSE_DONE
        out = formatter.final_sse(finished.reason.value, finished.choice)
        if not finished.final:
            return out  # n > 1: this choice ended, others run on
        if formatter.include_usage:
            out += sse(formatter.usage_chunk(finished.usage))
        return out + SSE_DONE

    async def _collect(
        self, stream: Generation, formatter: Formatter, watch: Callable[[Event], None] | None = None,
    ) -> web.Response:
        texts: dict[int, list[str]] = defaultdict(list)   # per choice (n > 1)
        logprobs: dict[int, list[common_pb2.TokenLogprob]] = defaultdict(list)
        reasons: dict[int, str] = {}
        finished: Finished | None = None
        async for event in stream:
            if watch is not None:
                watch(event)
            if isinstance(event, TextDelta):
                texts[event.choice].append(event.text)
                logprobs[event.choice].extend(event.logprobs)
            elif isinstance(event, Finished):
                finished = event
                reasons[event.choice] = event.reason.value
        if finished is None:
            raise GatewayError(ErrorKind.INTERNAL, "the generation ended without a result")
        error = finish_error(finished.reason, finished.message)
        if error is not None:
            raise error
        choices = [("".join(texts[i]), logprobs[i], reasons.get(i)) for i in range(max(reasons) + 1)]
        # One choice through `response`: a formatter may read it further (tool calls).
        body = (formatter.response(*choices[0], finished.usage) if len(choices) == 1
                else formatter.response_n(choices, finished.usage))
        return web.json_response(body, headers=stream.headers)

    # ---------------------------------------------------------------- other routes

    @staticmethod
    def _model_card(name: str, max_model_len: int, engines: int) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": 0, "owned_by": "kvmesh",
                "max_model_len": max_model_len, "engines": engines}

    async def models(self, request: web.Request) -> web.Response:
        """The models some engine serves now (served_models.py)."""
        principal = self._parts.frontdoor.authenticate(api_key_from_headers(request.headers))
        listed = await self._parts.frontdoor.listed_models(principal, self._parts.served)
        return web.json_response({"object": "list", "data": [self._model_card(*m) for m in listed]})

    async def model(self, request: web.Request) -> web.Response:
        principal = self._parts.frontdoor.authenticate(api_key_from_headers(request.headers))
        name = request.match_info["model"]
        own = self._parts.frontdoor.tokenizer_for(principal, name).max_model_len  # 404, then 403
        served = await self._parts.served.require(name)
        return web.json_response(self._model_card(name, served.max_model_len or own, served.engines))

    async def _tokenize_route(self, request: web.Request) -> web.Response:
        principal = self._parts.frontdoor.authenticate(api_key_from_headers(request.headers))
        return web.json_response(self._parts.tokenize.tokenize(principal, await self._read_json(request)))

    async def _detokenize_route(self, request: web.Request) -> web.Response:
        principal = self._parts.frontdoor.authenticate(api_key_from_headers(request.headers))
        return web.json_response(self._parts.tokenize.detokenize(principal, await self._read_json(request)))

    async def health(self, _: web.Request) -> web.Response:
        if not self._parts.scheduler.is_ready():
            raise GatewayError(
                ErrorKind.UNAVAILABLE,
                f"the scheduler at {self._parts.scheduler.address} is not reachable",
                code="scheduler_unavailable",
            )
        return web.json_response({"status": "ok", "scheduler": self._parts.scheduler.address})

    async def openapi(self, _: web.Request) -> web.Response:
        return web.json_response(openapi_document())
