"""The one request path every transport calls: HTTP chat/completions
(http_api.py), gRPC Chat/Generate (grpc_api.py) and `/v1/responses`
(responses_api.py) only decode their input into a `GenerationInput` and
render the events they get back.

`RequestPipeline.open` runs the steps in one order:

1. the tool-call decision (`tool_calls.parser_for`: the request's tools,
   the model's format) and the rules a transport cannot bend: a tool-calling
   stream cannot be resumed, nor one with n > 1, and tools take n = 1;
2. admission through the front door (frontdoor.py: the key's models, the
   tokenizer and context check, the rate-limit grant) -> a `Job`;
3. the resume point (a client's Last-Event-ID / `resume`);
4. the response cache lookup (response_cache/), for transports that use it;
5. the generation: the cache's replay or the driver's run (driver.py),
   behind an `EventStream`.

It hands back a `Generation`: the stream, the response headers
(x-request-id, the grant's rate-limit headers, the cache ticket's), the tool
parser if any, and `close()` (or `async with`) that closes the stream and
settles the rate-limit charge exactly once with the completion tokens it
counted -- whatever happens, also when the client leaves during the cache
lookup (then `open` settles before it re-raises).

Ownership: a `Generation` belongs to the one handler task that opened it;
it counts tokens as the transport iterates it, so no transport keeps its own
tally. Errors: `GatewayError` before the stream exists; a failed finish is
turned into the client's error by `errors.finish_error`.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from types import TracebackType

from services.common.clock import Clock
from services.common.openai_api.requests import GenerationInput
from services.common.tool_calling.parsers import ToolCallParser, parser_for
from services.common.tracing import NO_SPAN, Span
from services.gateway import request_trace
from services.gateway.batch_lines import BatchLine
from services.gateway.driver import GenerationDriver
from services.gateway.errors import ErrorKind, GatewayError
from services.gateway.event_stream import EventStream
from services.gateway.events import Event, TextDelta
from services.gateway.frontdoor import Admitted, Frontdoor
from services.gateway.jobs import Job
from services.gateway.keys import Principal
from services.gateway.metrics import GatewayMetrics

__all__ = ["Generation", "PipelineRequest", "RequestPipeline", "ResumePoint", "TokenCount", "Traced"]


@dataclass(frozen=True)
class ResumePoint:
    """A client re-sent a stream it lost: continue after event `last_index`."""

    last_index: int
    param: str   # how the transport names it in errors: "Last-Event-ID", "resume"


@dataclass
class TokenCount:
    """Completion tokens a request streamed: its settlement, its span."""

    completion_tokens: int = 0


@dataclass
class PipelineRequest:
    """What a transport decoded from its input."""

    request_id: str
    generation: GenerationInput
    principal: Principal
    priority: int                              # asked for; the key's ceiling caps it
    span: Span = NO_SPAN                       # its `gateway.request` span
    resume: ResumePoint | None = None
    # The transport's headers (HTTP) or metadata (gRPC), for the cache's
    # directives; None: this transport does not use the cache (Responses).
    cache_headers: Mapping[str, str] | None = None
    count: TokenCount = field(default_factory=TokenCount)
    # A line of the batch service (batch_lines.py): P2 with the batch marker
    # and deadline, replayed whole on a resume.
    batch: BatchLine | None = None


@dataclass
class Traced:
    """One request's `gateway.request` span and the tokens it streamed, from
    the transport's first line to its answer (`RequestPipeline.traced`)."""

    span: Span
    count: TokenCount = field(default_factory=TokenCount)
    status: int | str = 0   # the answer's HTTP status (gRPC: 0, an abort raises)

    def identify(self, request_id: str) -> None:
        """Name the request on its span, also when it is refused before admission."""
        self.span.set("kvmesh.request_id", request_id)

    def request(self, request_id: str, generation: GenerationInput, principal: Principal, priority: int,
                resume: ResumePoint | None = None, cache_headers: Mapping[str, str] | None = None,
                batch: BatchLine | None = None) -> PipelineRequest:
        """What to `open`, counted on this span."""
        return PipelineRequest(request_id, generation, principal, priority, self.span, resume, cache_headers,
                               self.count, batch)


class _Settlement:
    """Settles one admitted request's rate-limit charge, once, with the
    completion tokens counted so far."""

    def __init__(self, frontdoor: Frontdoor, admitted: Admitted, count: TokenCount) -> None:
        self._frontdoor = frontdoor
        self._admitted = admitted
        self.count = count
        self.done = False

    def __call__(self) -> None:
        if self.done:
            return
        self.done = True
        tokens = self.count.completion_tokens
        self._frontdoor.settle(self._admitted, tokens)
        self._admitted.job.trace.set("gen_ai.usage.output_tokens", tokens)


class Generation:
    """One admitted request's event stream and what settles it. Iterate it
    for the events (it counts their tokens); always `close()` it."""

    def __init__(self, stream: EventStream, job: Job, headers: dict[str, str], cache_headers: dict[str, str],
                 tool_parser: ToolCallParser | None, settle: _Settlement, metrics: GatewayMetrics) -> None:
        self.stream = stream
        self.job = job
        # x-request-id, the grant's rate-limit headers, the cache ticket's.
        self.headers = headers
        self.cache_headers = cache_headers   # the cache ticket's alone (gRPC initial metadata)
        self.tool_parser = tool_parser
        self.count = settle.count
        self._settle = settle
        self._metrics = metrics
        self._events: AsyncIterator[Event] | None = None
        self._closed = False

    @property
    def resumable(self) -> bool:
        """An engine keeps this stream (a cache replay is not resumable)."""
        return self.stream.resumable

    def mark_output(self) -> None:
        self.stream.mark_output()

    def __aiter__(self) -> Generation:
        return self

    async def __anext__(self) -> Event:
        if self._events is None:
            self._events = aiter(self.stream)
        event = await anext(self._events)
        if isinstance(event, TextDelta):
            self.count.completion_tokens += len(event.token_ids)
        return event

    async def close(self) -> None:
        """Close the stream (cancelling a generation still running) and
        settle the charge; a second call does nothing."""
        if self._closed:
            return
        self._closed = True
        try:
            await self.stream.aclose()
        finally:
            self._metrics.active_streams.dec()
            self._settle()

    async def __aenter__(self) -> Generation:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()


class RequestPipeline:
    """Shared by every transport of one gateway; holds no request's state."""

    def __init__(self, frontdoor: Frontdoor, driver: GenerationDriver, metrics: GatewayMetrics) -> None:
        self.frontdoor = frontdoor
        self._driver = driver
        self._metrics = metrics

    @property
    def clock(self) -> Clock:
        """The driver's: a batch line's timing reads the time its generation does."""
        return self._driver.clock

    @contextlib.asynccontextmanager
    async def traced(self, headers: Mapping[str, str], route: str, grpc: bool = False) -> AsyncIterator[Traced]:
        """The request's span (request_trace.py) around the transport's whole
        handling: ended as failed with the exception that escapes, else as
        finished with `Traced.status`; its output tokens are the count."""
        traced = Traced(request_trace.start(self.frontdoor.tracing, headers, route))
        try:
            yield traced
        except BaseException as exc:
            request_trace.failed(traced.span, exc, traced.count.completion_tokens, grpc=grpc)
            raise
        request_trace.finished(traced.span, traced.count.completion_tokens, traced.status, grpc=grpc)

    def authenticate(self, raw_key: str | None) -> Principal:
        return self.frontdoor.authenticate(raw_key)

    def tool_parser(self, generation: GenerationInput, resume: ResumePoint | None = None) -> ToolCallParser | None:
        """The parser for the request's output, if it calls tools; refuses
        what one parser over one stream cannot do."""
        if resume is not None and generation.n > 1:
            raise GatewayError(ErrorKind.INVALID_REQUEST, "a stream with n > 1 cannot be resumed; send the "
                               "request again", param=resume.param)
        parser = parser_for(generation, self.frontdoor.model_tool_parser(generation.model))
        if parser is None:
            return None
        if resume is not None:
            raise GatewayError(ErrorKind.INVALID_REQUEST, "a tool-calling stream cannot be resumed; send the "
                               f"request again without {resume.param}", param=resume.param)
        if generation.n > 1:  # one parser reads one choice
            raise GatewayError(ErrorKind.INVALID_REQUEST, "n > 1 with tools is not supported; send n requests",
                               param="n")
        return parser

    async def open(self, request: PipelineRequest) -> Generation:
        """Admit the request and start its generation (steps 1-5 above)."""
        generation = request.generation
        parser = self.tool_parser(generation, request.resume)
        admitted = await self.frontdoor.admit(generation, request.principal, request.priority,
                                              request.request_id, request.span)
        job = admitted.job
        if request.resume is not None:
            job.resume_from = request.resume.last_index
        settle = _Settlement(self.frontdoor, admitted, request.count)
        if request.batch is not None:
            try:
                # As late as can be: nothing awaits between this and the job's start.
                request.batch.check_admissible(self.clock.wall())
            except BaseException:
                settle()
                raise
            request.batch.apply(job)
        cache = self.frontdoor.cache
        try:
            ticket = (None if request.cache_headers is None else
                      await cache.lookup(job, generation, request.principal, request.cache_headers,
                                         request.resume is not None))
        except BaseException:   # the client left during the lookup: settle its grant all the same
            settle()
            raise
        try:
            stream = self._driver.start(job) if ticket is None else cache.start(ticket, job, self._driver)
        except BaseException:
            settle()
            raise
        self._metrics.active_streams.inc()
        ticket_headers = {} if ticket is None else ticket.headers
        headers = {"x-request-id": request.request_id, **admitted.grant.headers, **ticket_headers}
        return Generation(stream, job, headers, ticket_headers, parser, settle, self._metrics)
