"""`POST /v1/responses` (and GET / DELETE of a stored response) on the
gateway's HTTP API, served ON the chat path.

A Responses request is parsed (services/common/openai_api/responses_input.py),
joined to the items of the response it continues (responses_store.py), and
becomes a chat `GenerationInput` through `parse_chat_body`; from there it is a
chat request like any other, through the one request pipeline
(pipeline.py `RequestPipeline.open`: the same key, model and context checks,
rate limits, priority class, tool-call decision, admission, placement,
migration and heartbeats; no response cache). Its output goes through the
tool-call splitter (responses_output.py) into a `ResponseBuilder`
(responses_format.py): typed SSE events when streamed, the Response object
when not. Errors are raised as `GatewayError` to the HTTP API's one error
boundary; once the event stream has started, a failure ends it with
`response.failed`.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from services.common.openai_api.requests import parse_chat_body
from services.common.openai_api.responses_events import ResponseBuilder, event_sse, new_response_id
from services.common.openai_api.responses_input import (
    ResponsesRequest,
    chat_body,
    parse_responses_body,
    responses_param,
)
from services.common.tool_calling.parsers import ToolCallParser
from services.common.tool_calling.responses_output import OutputSplitter, PlainText, ToolSplitter
from services.gateway.errors import ErrorKind, GatewayError, finish_error
from services.gateway.events import Event, Finished, TextDelta
from services.gateway.jobs import request_id_from
from services.gateway.keys import Principal, api_key_from_headers
from services.gateway.pipeline import Generation, RequestPipeline, Traced
from services.gateway.responses_store import ResponsesStore, StoredResponse, StoreUnavailable
from services.gateway.sse_relay import relay_sse
from services.gateway.validation import parse_priority_header

__all__ = ["ResponsesApi"]

log = logging.getLogger(__name__)

ReadJson = Callable[[web.Request], Awaitable[Any]]


def _renamed(exc: GatewayError) -> GatewayError:
    """A chat-path error with its parameter named as the Responses request names it."""
    exc.param = responses_param(exc.param)
    if exc.param == "max_output_tokens":
        exc.message = exc.message.replace("max_completion_tokens", "max_output_tokens")
    return exc


def _not_found(response_id: str, param: str | None) -> GatewayError:
    what = "Previous response" if param == "previous_response_id" else "Response"
    return GatewayError(ErrorKind.NOT_FOUND, f"{what} with id {response_id[:80]!r} not found: responses are kept "
                        "only with store: true, for responses.ttl_seconds, in responses.store (embedded: by the "
                        "gateway that served them alone), for the API key that created them", param=param,
                        code="response_not_found")


def _unavailable(exc: StoreUnavailable) -> GatewayError:
    return GatewayError(ErrorKind.UNAVAILABLE, f"{exc}; retry later", code="responses_store_unavailable",
                        retry_after=exc.retry_after)


def _sse(events: list[dict[str, Any]]) -> bytes:
    return b"".join(event_sse(e) for e in events)


class _Run:
    """One request's output: the splitter, the builder, and the store once it ends."""

    def __init__(self, api: ResponsesApi, parsed: ResponsesRequest, principal: Principal,
                 history: list[dict[str, Any]], tool_parser: ToolCallParser | None) -> None:
        self.builder = ResponseBuilder(new_response_id(), parsed.model, parsed.settings,
                                       previous_response_id=parsed.previous_response_id,
                                       metadata=parsed.metadata, store=parsed.store)
        self.opening = self.builder.start()  # numbered first; sent when a stream starts
        # The pipeline's tool-call decision (the chat path's), or plain text.
        self.splitter: OutputSplitter = PlainText() if tool_parser is None else ToolSplitter(tool_parser)
        self._keep = (api.store, principal.key_id, [*history, *parsed.items]) if parsed.store else None
        self._completed = False

    def text(self, delta: TextDelta) -> list[dict[str, Any]]:
        return self._pieces(self.splitter.feed(delta.text))

    def _pieces(self, pieces: list[Any]) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        for piece in pieces:
            if isinstance(piece, str):
                events += self.builder.text(piece)
            else:
                events += self.builder.tool_call(piece.index, piece.call_id, piece.name, piece.arguments)
        return events

    def end(self, finished: Finished) -> list[dict[str, Any]]:
        error = finish_error(finished.reason, finished.message)
        if error is not None:
            return self.builder.fail(error.kind.value, error.message)
        events = self._pieces(self.splitter.finish())
        events += self.builder.finish(finished.reason.value, finished.usage)
        self._completed = True
        return events

    async def keep(self) -> None:
        """Store a completed response (store: true) BEFORE its client sees it
        end: the client's next turn may reach another gateway at once. A
        failure to store does not fail the answer (the generation is done)."""
        if self._keep is None or not self._completed:
            return
        store, owner, history = self._keep
        try:
            if not await store.put(owner, self.builder.response(), history):
                log.warning("response %s is larger than responses.max_bytes: not stored", self.builder.id)
        except StoreUnavailable as exc:
            log.warning("response %s not stored: %s", self.builder.id, exc)


class ResponsesApi:
    def __init__(self, pipeline: RequestPipeline, store: ResponsesStore, read_json: ReadJson,
                 request_key: web.RequestKey[str]) -> None:
        self.store = store
        self._pipeline = pipeline
        self._read_json = read_json
        self._request_key = request_key

    def register(self, app: web.Application) -> None:
        app.router.add_post("/v1/responses", self.create)
        app.router.add_get("/v1/responses/{response_id}", self.retrieve)
        app.router.add_delete("/v1/responses/{response_id}", self.delete)

    # ---------------------------------------------------------------- stored

    def _owner(self, request: web.Request) -> str:
        return self._pipeline.authenticate(api_key_from_headers(request.headers)).key_id

    async def retrieve(self, request: web.Request) -> web.Response:
        response_id = request.match_info["response_id"]
        entry = await self._get(self._owner(request), response_id)
        if entry is None:
            raise _not_found(response_id, None)
        return web.json_response(entry.response)

    async def delete(self, request: web.Request) -> web.Response:
        response_id = request.match_info["response_id"]
        try:
            deleted = await self.store.delete(self._owner(request), response_id)
        except StoreUnavailable as exc:
            raise _unavailable(exc) from None
        if not deleted:
            raise _not_found(response_id, None)
        return web.json_response({"id": response_id, "object": "response.deleted", "deleted": True})

    # ---------------------------------------------------------------- create

    async def _get(self, owner: str, response_id: str) -> StoredResponse | None:
        try:
            return await self.store.get(owner, response_id)
        except StoreUnavailable as exc:
            raise _unavailable(exc) from None

    async def _history(self, parsed: ResponsesRequest, principal: Principal) -> list[dict[str, Any]]:
        if parsed.store and not self.store.enabled:
            raise GatewayError(ErrorKind.INVALID_REQUEST, "this gateway stores no responses "
                               "(responses.max_entries is 0); send store: false", param="store")
        if parsed.previous_response_id is None:
            return []
        entry = await self._get(principal.key_id, parsed.previous_response_id)
        if entry is None:
            raise _not_found(parsed.previous_response_id, "previous_response_id")
        return entry.conversation

    async def create(self, request: web.Request) -> web.StreamResponse:
        async with self._pipeline.traced(request.headers, "responses") as traced:
            response = await self._create(request, traced)
            traced.status = response.status
        return response

    async def _create(self, request: web.Request, traced: Traced) -> web.StreamResponse:
        """Decode the body into a chat request, run it through the pipeline
        (no response cache), render its events as the Responses API's."""
        request_id = request_id_from(request.headers.get("x-request-id"), request.headers.get("x-envoy-attempt-count"))
        request[self._request_key] = request_id
        traced.identify(request_id)
        principal = self._pipeline.authenticate(api_key_from_headers(request.headers))
        parsed = parse_responses_body(await self._read_json(request))
        history = await self._history(parsed, principal)
        priority = parse_priority_header(request.headers.get("x-priority"))
        try:
            generation = parse_chat_body(chat_body(parsed, history))
            opened = await self._pipeline.open(traced.request(request_id, generation, principal, priority))
        except GatewayError as exc:
            raise _renamed(exc) from None
        async with opened as stream:
            run = _Run(self, parsed, principal, history, stream.tool_parser)
            if parsed.stream:
                return await self._stream(request, stream, run)
            return await self._collect(stream, run)

    async def _collect(self, stream: Generation, run: _Run) -> web.Response:
        finished: Finished | None = None
        async for event in stream:
            if isinstance(event, TextDelta):
                run.text(event)
            elif isinstance(event, Finished):
                finished = event
        if finished is None:
            raise GatewayError(ErrorKind.INTERNAL, "the generation ended without a result")
        error = finish_error(finished.reason, finished.message)
        if error is not None:
            raise error
        run.end(finished)
        await run.keep()
        return web.json_response(run.builder.response(), headers=stream.headers)

    @staticmethod
    async def _stream(request: web.Request, stream: Generation, run: _Run) -> web.StreamResponse:
        """Typed events (sse_relay.py: the response starts lazily, so a quick
        refusal keeps its real status)."""

        def render(event: Event) -> bytes | None:
            if isinstance(event, TextDelta):
                return _sse(run.text(event))
            if isinstance(event, Finished):
                return _sse(run.end(event))
            return None

        return await relay_sse(request, stream, _sse(run.opening), render,
                               lambda exc: _sse(run.builder.fail(exc.code or exc.kind.value, exc.message)),
                               before_end=run.keep)
