"""The OpenAI-compatible HTTP API (aiohttp).

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

An SSE response starts lazily: at the first token, or at the first heartbeat
while queued. So a request the scheduler rejects quickly still gets a real
429/503 status, while a long wait in the queue keeps the connection alive.
"""

from __future__ import annotations

import functools
import logging
from collections import defaultdict
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from services.common.clock import SystemClock
from services.common.config import MeshConfig
from services.common.openai_api.errors import error_response
from services.common.openai_api.requests import parse_chat_body, parse_completion_body, parse_json_body
from services.common.openai_api.responses import (
    SSE_DONE,
    SSE_HEARTBEAT,
    ChatFormatter,
    CompletionFormatter,
    Formatter,
    sse,
)
from services.common.proto.kvmesh.v1 import common_pb2
from services.common.tracing import Span
from services.gateway import request_trace
from services.gateway.batch_lines import BATCH_PRIORITY, BatchLines, LineTiming
from services.gateway.driver import GenerationDriver
from services.gateway.errors import ErrorKind, GatewayError, http_error
from services.gateway.event_stream import EventStream
from services.gateway.events import Event, Finished, Heartbeat, TextDelta
from services.gateway.frontdoor import Admitted, Frontdoor
from services.gateway.jobs import parse_last_event_id, request_id_from
from services.gateway.keys import api_key_from_headers
from services.gateway.metrics import GatewayMetrics, error_label
from services.gateway.openapi import openapi_document
from services.gateway.responses_api import ResponsesApi
from services.gateway.responses_store import ResponseStore
from services.gateway.scheduler_client import SchedulerClient
from services.gateway.served_models import ServedModels
from services.gateway.tokenize_api import TokenizeApi
from services.gateway.tool_calls import parser_for
from services.gateway.tool_output import ToolChatFormatter
from services.gateway.validation import parse_priority_header

__all__ = ["HttpApi"]

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

_REQUEST_ID = web.RequestKey("request_id", str)



def _error_response(exc: GatewayError, request_id: str | None) -> web.Response:
    return error_response(exc, {"x-request-id": request_id} if request_id else None)


def _event_id(sse_id: bytes, index: int) -> bytes:
    """`id: <request_id>.<index>` before a chunk; nothing for a stream that
    cannot be resumed (sse_id empty)."""
    return b"%s%d\n" % (sse_id, index) if sse_id else b""


def _failure(finished: Finished) -> GatewayError:
    """A generation that ended without success, as the client's error."""
    kind = ErrorKind.TIMEOUT if finished.reason.value == "timeout" else ErrorKind.GENERATION_FAILED
    message = finished.message or f"the generation ended with {finished.reason.value}"
    return GatewayError(kind, message, code=finished.reason.value)


class HttpApi:
    def __init__(
        self,
        config: MeshConfig,
        frontdoor: Frontdoor,
        driver: GenerationDriver,
        scheduler: SchedulerClient,
        metrics: GatewayMetrics,
        served: ServedModels | None = None,
        responses_store: ResponseStore | None = None,
    ) -> None:
        self._config = config
        self._frontdoor = frontdoor
        self._driver = driver
        self._scheduler = scheduler
        self._metrics = metrics
        self._served = served or ServedModels(functools.partial(scheduler.get_state, 1.0), SystemClock())
        self._tokenize = TokenizeApi(frontdoor)
        self.responses_store = responses_store or ResponseStore(config.responses, SystemClock())
        # Lines of the batch service (batch_lines.py): only with its internal credential.
        self._batch_lines = BatchLines(config, frontdoor.keys)

    def app(self) -> web.Application:
        """The routes (the Files + Batch API is the batch service's, services/batch/)."""
        app = web.Application(
            middlewares=[self._error_middleware],
            client_max_size=self._config.gateway.max_body_bytes,
        )
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/completions", self.completions)
        ResponsesApi(self._frontdoor, self._driver, self._metrics, self.responses_store, self._read_json,
                     _REQUEST_ID).register(app)
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
            self._metrics.rejected(error_label(exc.code, exc.kind.value))
            response = _error_response(exc, request.get(_REQUEST_ID))
            status = response.status
            return response
        except web.HTTPRequestEntityTooLarge:
            self._metrics.rejected("request_too_large")
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
            self._metrics.rejected(kind.value)
            response = _error_response(GatewayError(kind, message), None)
            response.set_status(exc.status)
            status = exc.status
            return response
        finally:
            self._metrics.requests.labels(route, str(status)).inc()

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
        span = request_trace.start(self._frontdoor.tracing, request.headers, route)
        tally = _Tally()
        try:
            response = await self._generate_traced(request, route, span, tally)
        except BaseException as exc:
            request_trace.failed(span, exc, tally.completion_tokens)
            raise
        request_trace.finished(span, tally.completion_tokens, response.status)
        return response

    async def _generate_traced(
        self, request: web.Request, route: str, span: Span, tally: _Tally,
    ) -> web.StreamResponse:
        resume = parse_last_event_id(request.headers.get("last-event-id"))
        line = self._batch_lines.read(request.headers)   # None unless the batch service sent it
        request_id = line.request_id if line else resume[0] if resume else request_id_from(
            request.headers.get("x-request-id"), request.headers.get("x-envoy-attempt-count"))
        request[_REQUEST_ID] = request_id
        span.set("kvmesh.request_id", request_id)  # also on a request refused before admission
        principal = line.principal if line else self._frontdoor.authenticate(api_key_from_headers(request.headers))
        body = await self._read_json(request)
        generation = parse_chat_body(body) if route == "chat" else parse_completion_body(body)
        priority = BATCH_PRIORITY if line else parse_priority_header(request.headers.get("x-priority"))
        if resume and not generation.stream:
            raise GatewayError(ErrorKind.INVALID_REQUEST, "Last-Event-ID resumes a streamed response; "
                               "set \"stream\": true", param="Last-Event-ID")
        if resume and generation.n > 1:
            raise GatewayError(ErrorKind.INVALID_REQUEST, "a stream with n > 1 cannot be resumed; send the "
                               "request again", param="Last-Event-ID")
        # Tool calls are parsed out of the text (services/gateway/tool_output.py).
        tool_parser = parser_for(generation, self._frontdoor.tokenizers.get(generation.model).tool_parser)
        if resume and tool_parser is not None:
            raise GatewayError(ErrorKind.INVALID_REQUEST, "a tool-calling stream cannot be resumed; send the "
                               "request again without Last-Event-ID", param="Last-Event-ID")
        if tool_parser is not None and generation.n > 1:
            raise GatewayError(ErrorKind.INVALID_REQUEST, "n > 1 with tools is not supported; send n requests",
                               param="n")
        admitted = await self._frontdoor.admit(generation, principal, priority, request_id, span)
        if resume:
            admitted.job.resume_from = resume[1]
        if line:
            line.apply(admitted.job)
        formatter: Formatter
        if tool_parser is not None:
            formatter = ToolChatFormatter(request_id, generation.model, generation.include_usage, tool_parser)
        else:
            formatter_cls = ChatFormatter if route == "chat" else CompletionFormatter
            formatter = formatter_cls(request_id, generation.model, generation.include_usage)
        # The response cache (response_cache/): a hit never reaches the driver.
        cache = self._frontdoor.cache
        try:
            ticket = await cache.lookup(admitted.job, generation, principal, request.headers, bool(resume or line))
        except BaseException:   # the client left during the lookup: settle its grant all the same
            self._settle(admitted, tally)
            raise
        headers = {"x-request-id": request_id, **admitted.grant.headers, **ticket.headers}
        self._metrics.active_streams.inc()
        stream = cache.start(ticket, admitted.job, self._driver)
        try:
            if generation.stream:
                return await self._stream(request, stream, formatter, headers, tally, resume is not None,
                                          generation.n)
            return await self._collect_timed(stream, formatter, headers, tally, line is not None)
        finally:
            await stream.aclose()
            self._metrics.active_streams.dec()
            self._settle(admitted, tally)

    def _settle(self, admitted: Admitted, tally: _Tally) -> None:
        self._frontdoor.settle(admitted, tally.completion_tokens)

    async def _stream(
        self,
        request: web.Request,
        stream: EventStream,
        formatter: Formatter,
        headers: dict[str, str],
        tally: _Tally,
        resumed: bool,
        n: int = 1,
    ) -> web.StreamResponse:
        response: web.StreamResponse | None = None
        # Event ids (resume points) only where a stream can be resumed: one
        # choice, no tool calls held back.
        sse_id = (f"id: {request[_REQUEST_ID]}.".encode() if n == 1 and formatter.resumable and stream.resumable
                  else b"")

        async def started() -> web.StreamResponse:
            nonlocal response
            if response is None:
                response = web.StreamResponse(
                    status=200,
                    headers={
                        "Content-Type": "text/event-stream",
                        "Cache-Control": "no-cache",
                        "X-Accel-Buffering": "no",
                        **headers,
                    },
                )
                await response.prepare(request)
                if not resumed:
                    await response.write(self._first_bytes(formatter, n, sse_id))
            return response

        try:
            async for event in stream:
                if isinstance(event, TextDelta):
                    tally.completion_tokens += len(event.token_ids)
                    out = await started()
                    await self._write_delta(out, formatter, event, sse_id, stream)
                elif isinstance(event, Finished):
                    out = await started()
                    await out.write(self._final_bytes(formatter, event))
                elif isinstance(event, Heartbeat):
                    out = await started()
                    await out.write(SSE_HEARTBEAT)
                # QueuedUpdate: OpenAI's stream has no place for it (heartbeats cover it).
        except GatewayError as exc:
            if response is None:
                raise
            await response.write(sse(http_error(exc).body) + SSE_DONE)
        except ConnectionResetError:
            log.info("request %s: client went away", request.get(_REQUEST_ID))
            if response is None:
                raise
            return response
        out = await started()
        await out.write_eof()
        return out

    @staticmethod
    def _first_bytes(formatter: Formatter, n: int, sse_id: bytes) -> bytes:
        """The role chunk (chat), one per choice; with one choice, event 0."""
        if formatter.first_chunk() is None:
            return b""
        if n == 1:
            return _event_id(sse_id, 0) + sse(formatter.first_chunk() or {})
        return b"".join(sse(formatter.first_chunk(i) or {}) for i in range(n))

    @staticmethod
    async def _write_delta(
        out: web.StreamResponse, formatter: Formatter, event: TextDelta, sse_id: bytes, stream: EventStream,
    ) -> None:
        """The delta's chunks, with its resume id when the formatter has
        them; nothing when it has none to send yet (a tool call held back)."""
        chunk = formatter.delta_sse(event.text, event.logprobs, index=event.choice)
        if chunk:
            await out.write(_event_id(sse_id, event.index) + chunk)
            stream.mark_output()

    @staticmethod
    def _final_bytes(formatter: Formatter, finished: Finished) -> bytes:
        if not finished.reason.ok:
            return sse(http_error(_failure(finished)).body) + SSE_DONE
        out = formatter.final_sse(finished.reason.value, finished.choice)
        if not finished.final:
            return out  # n > 1: this choice ended, others run on
        if formatter.include_usage:
            out += sse(formatter.usage_chunk(finished.usage))
        return out + SSE_DONE

    async def _collect_timed(
        self, stream: EventStream, formatter: Formatter, headers: dict[str, str], tally: _Tally, timed: bool,
    ) -> web.Response:
        """`_collect`; a batch line's answer also tells its timing (batch_lines.py)."""
        timing = LineTiming(self._driver.clock) if timed else None
        response = await self._collect(stream, formatter, headers, tally, timing.see if timing else None)
        if timing:
            response.headers.update(timing.headers())
        return response

    async def _collect(
        self,
        stream: EventStream,
        formatter: Formatter,
        headers: dict[str, str],
        tally: _Tally,
        watch: Callable[[Event], None] | None = None,
    ) -> web.Response:
        texts: dict[int, list[str]] = defaultdict(list)   # per choice (n > 1)
        logprobs: dict[int, list[common_pb2.TokenLogprob]] = defaultdict(list)
        reasons: dict[int, str] = {}
        finished: Finished | None = None
        async for event in stream:
            if watch is not None:
                watch(event)   # a batch line's timing
            if isinstance(event, TextDelta):
                tally.completion_tokens += len(event.token_ids)
                texts[event.choice].append(event.text)
                logprobs[event.choice].extend(event.logprobs)
            elif isinstance(event, Finished):
                finished = event
                reasons[event.choice] = event.reason.value
        if finished is None:
            raise GatewayError(ErrorKind.INTERNAL, "the generation ended without a result")
        if not finished.reason.ok:
            raise _failure(finished)
        choices = [("".join(texts[i]), logprobs[i], reasons.get(i)) for i in range(max(reasons) + 1)]
        # One choice through `response`: a formatter may read it further (tool calls).
        body = (formatter.response(*choices[0], finished.usage) if len(choices) == 1
                else formatter.response_n(choices, finished.usage))
        return web.json_response(body, headers=headers)

    # ---------------------------------------------------------------- other routes

    @staticmethod
    def _model_card(name: str, max_model_len: int, engines: int) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": 0, "owned_by": "kvmesh",
                "max_model_len": max_model_len, "engines": engines}

    def _own_length(self, name: str) -> int:
        return self._frontdoor.tokenizers.get(name).max_model_len

    async def models(self, request: web.Request) -> web.Response:
        """The models some engine serves now (served_models.py)."""
        principal = self._frontdoor.authenticate(api_key_from_headers(request.headers))
        listed = await self._served.listed(
            self._frontdoor.tokenizers.names, lambda n: self._frontdoor.keys.allows(principal, n), self._own_length)
        return web.json_response({"object": "list", "data": [self._model_card(*m) for m in listed]})

    async def model(self, request: web.Request) -> web.Response:
        principal = self._frontdoor.authenticate(api_key_from_headers(request.headers))
        name = request.match_info["model"]
        own = self._own_length(name)  # 404 for a model not configured
        self._frontdoor.keys.check_model(principal, name)
        served = await self._served.require(name)
        return web.json_response(self._model_card(name, served.max_model_len or own, served.engines))

    async def _tokenize_route(self, request: web.Request) -> web.Response:
        principal = self._frontdoor.authenticate(api_key_from_headers(request.headers))
        return web.json_response(self._tokenize.tokenize(principal, await self._read_json(request)))

    async def _detokenize_route(self, request: web.Request) -> web.Response:
        principal = self._frontdoor.authenticate(api_key_from_headers(request.headers))
        return web.json_response(self._tokenize.detokenize(principal, await self._read_json(request)))

    async def health(self, _: web.Request) -> web.Response:
        if not self._scheduler.is_ready():
            raise GatewayError(
                ErrorKind.UNAVAILABLE,
                f"the scheduler at {self._scheduler.address} is not reachable",
                code="scheduler_unavailable",
            )
        return web.json_response({"status": "ok", "scheduler": self._scheduler.address})

    async def openapi(self, _: web.Request) -> web.Response:
        return web.json_response(openapi_document())


class _Tally:
    """Tokens a request produced, for settling its rate-limit charge."""

    __slots__ = ("completion_tokens",)

    def __init__(self) -> None:
        self.completion_tokens = 0
