"""The one request pipeline (services/gateway/pipeline.py) over in-process
fakes of the front door, the response cache and the driver: the charge is
settled exactly once whatever happens, the tool-call rules, the headers it
hands back; and the one finish reason -> client error table (errors.py)."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Mapping
from typing import Any, cast

import pytest

from services.common.clock import FakeClock
from services.common.finish_reason import FinishReason
from services.common.openai_api.requests import GenerationInput, SamplingOptions, parse_chat_body
from services.common.tracing import Span
from services.gateway.driver import GenerationDriver
from services.gateway.errors import ErrorKind, GatewayError, finish_error
from services.gateway.event_stream import EventStream
from services.gateway.events import Emit, Finished, TextDelta, Usage
from services.gateway.frontdoor import Admitted, Frontdoor
from services.gateway.jobs import Job
from services.gateway.keys import Principal
from services.gateway.limits import Grant
from services.gateway.metrics import GatewayMetrics
from services.gateway.pipeline import PipelineRequest, RequestPipeline, ResumePoint, TokenCount
from services.gateway.response_cache import CacheStatus, Ticket

PRINCIPAL = Principal("k", "acme", 0, frozenset(), 0.0, 0.0, 0.0)
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


def _job(request_id: str) -> Job:
    return Job(request_id=request_id, route="chat", model="m", tenant="acme", priority=0, prompt_ids=[1, 2, 3],
               prefix_hashes=[], sampling=SamplingOptions(temperature=0.0), max_tokens=16,
               max_generation_seconds=120.0, arrival_unix=0.0, arrival_monotonic=0.0, hash_block_tokens=16)


class FakeFrontdoor:
    """Admits everything; records each settlement."""

    def __init__(self) -> None:
        self.settled: list[tuple[str, int]] = []
        self.cache = FakeCache()
        self.admitted: list[Admitted] = []

    def model_tool_parser(self, model: str) -> str:
        return "hermes"

    async def admit(self, request: GenerationInput, principal: Principal, priority: int, request_id: str,
                    trace: Span) -> Admitted:
        admitted = Admitted(_job(request_id), principal, Grant("k", 100, {"x-ratelimit-limit-requests": "9"}))
        self.admitted.append(admitted)
        return admitted

    def settle(self, admitted: Admitted, completion_tokens: int) -> None:
        self.settled.append((admitted.job.request_id, completion_tokens))


class FakeCache:
    """A miss, or (`block`) a lookup that waits until cancelled."""

    def __init__(self) -> None:
        self.block = False
        self.looked_up = 0
        self.waiting = asyncio.Event()

    async def lookup(self, job: Job, request: GenerationInput, principal: Principal,
                     headers: Mapping[str, str], resumed: bool = False) -> Ticket:
        self.looked_up += 1
        if self.block:
            self.waiting.set()
            await asyncio.Event().wait()
        return Ticket(CacheStatus.MISS, "key")

    def start(self, ticket: Ticket, job: Job, driver: FakeDriver) -> EventStream:
        return driver.start(job)


class FakeDriver:
    """Two deltas (3 tokens), then `Finished` -- or `fail` raises mid-run."""

    def __init__(self) -> None:
        self.started = 0
        self.fail: GatewayError | None = None
        self.hold = asyncio.Event()   # cleared: the run waits after its first delta
        self.hold.set()
        self.broken = False           # start raises

    def start(self, job: Job) -> EventStream:
        if self.broken:
            raise RuntimeError("cannot start")
        self.started += 1

        async def run(emit: Emit) -> None:
            await emit(TextDelta("a", [1, 2], [], 1))
            await self.hold.wait()
            if self.fail is not None:
                raise self.fail
            await emit(TextDelta("b", [3], [], 2))
            await emit(Finished(FinishReason.STOP, Usage(3, 3, 0)))

        return EventStream(run, 60.0, FakeClock())


def _pipeline() -> tuple[RequestPipeline, FakeFrontdoor, FakeDriver, GatewayMetrics]:
    frontdoor, driver, metrics = FakeFrontdoor(), FakeDriver(), GatewayMetrics()
    pipeline = RequestPipeline(cast(Frontdoor, frontdoor), cast(GenerationDriver, driver), metrics)
    return pipeline, frontdoor, driver, metrics


def _request(request_id: str = "r1", headers: Mapping[str, str] | None = None, **body: Any) -> PipelineRequest:
    generation = parse_chat_body({"model": "m", "messages": [{"role": "user", "content": "hi"}], **body})
    return PipelineRequest(request_id, generation, PRINCIPAL, 1, cache_headers=headers)


# ---------------------------------------------------------------- settling


async def test_a_finished_generation_is_settled_once_with_the_tokens_it_streamed() -> None:
    pipeline, frontdoor, _, metrics = _pipeline()
    run = await pipeline.open(_request(headers={}))
    assert metrics.active_streams.count == 1
    events = [event async for event in run]
    assert isinstance(events[-1], Finished)
    assert run.count.completion_tokens == 3
    await run.close()
    await run.close()   # a second close does nothing
    assert frontdoor.settled == [("r1", 3)]
    assert metrics.active_streams.count == 0
    assert run.headers == {"x-request-id": "r1", "x-ratelimit-limit-requests": "9", "X-Kvmesh-Cache": "miss"}
    assert run.cache_headers == {"X-Kvmesh-Cache": "miss"}


async def test_a_transport_error_mid_stream_still_settles_once() -> None:
    pipeline, frontdoor, driver, metrics = _pipeline()
    driver.hold.clear()
    count = TokenCount()
    request = dataclasses.replace(_request(headers={}), count=count)
    with pytest.raises(ConnectionResetError):
        async with await pipeline.open(request) as run:
            async for event in run:
                if isinstance(event, TextDelta):
                    raise ConnectionResetError   # the client went away while we wrote
    assert frontdoor.settled == [("r1", 2)]
    assert count.completion_tokens == 2   # the transport's count: its span's output tokens
    assert metrics.active_streams.count == 0


async def test_a_generation_that_fails_is_settled_once() -> None:
    pipeline, frontdoor, driver, _ = _pipeline()
    driver.fail = GatewayError(ErrorKind.UNAVAILABLE, "no engine")
    with pytest.raises(GatewayError):
        async with await pipeline.open(_request(headers={})) as run:
            async for _event in run:
                pass
    assert frontdoor.settled == [("r1", 2)]


async def test_a_client_that_leaves_during_the_cache_lookup_is_settled_once_and_nothing_starts() -> None:
    pipeline, frontdoor, driver, metrics = _pipeline()
    frontdoor.cache.block = True
    task = asyncio.get_running_loop().create_task(pipeline.open(_request(headers={})))
    await frontdoor.cache.waiting.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert frontdoor.settled == [("r1", 0)]
    assert driver.started == 0
    assert metrics.active_streams.count == 0


async def test_a_generation_that_cannot_start_is_settled_once() -> None:
    pipeline, frontdoor, driver, metrics = _pipeline()
    driver.broken = True
    with pytest.raises(RuntimeError):
        await pipeline.open(_request(headers={}))
    assert frontdoor.settled == [("r1", 0)]
    assert metrics.active_streams.count == 0


async def test_without_cache_headers_the_cache_is_not_asked() -> None:
    pipeline, frontdoor, driver, _ = _pipeline()
    async with await pipeline.open(_request(headers=None)) as run:
        assert run.headers == {"x-request-id": "r1", "x-ratelimit-limit-requests": "9"}
    assert frontdoor.cache.looked_up == 0
    assert driver.started == 1
    assert frontdoor.settled == [("r1", 0)]


async def test_the_resume_point_reaches_the_job() -> None:
    pipeline, frontdoor, _, _ = _pipeline()
    request = dataclasses.replace(_request(headers={}), resume=ResumePoint(7, "Last-Event-ID"))
    async with await pipeline.open(request) as run:
        assert run.job.resume_from == 7
    assert frontdoor.admitted[0].job.resume_from == 7


# ---------------------------------------------------------------- tool-call rules


@pytest.mark.parametrize(("changes", "resume", "param", "says"), [
    ({"n": 2, "stream": True}, ResumePoint(3, "Last-Event-ID"), "Last-Event-ID", "n > 1 cannot be resumed"),
    ({"tools": TOOLS}, ResumePoint(3, "resume"), "resume", "without resume"),
    ({"tools": TOOLS}, ResumePoint(3, "Last-Event-ID"), "Last-Event-ID", "without Last-Event-ID"),
    ({"tools": TOOLS, "n": 2}, None, "n", "n > 1 with tools"),
])
async def test_what_one_parser_over_one_stream_cannot_do_is_refused_before_admission(
    changes: dict[str, Any], resume: ResumePoint | None, param: str, says: str,
) -> None:
    pipeline, frontdoor, _, _ = _pipeline()
    request = dataclasses.replace(_request(headers={}, **changes), resume=resume)
    with pytest.raises(GatewayError) as raised:
        await pipeline.open(request)
    assert raised.value.kind is ErrorKind.INVALID_REQUEST
    assert raised.value.param == param
    assert says in raised.value.message
    assert frontdoor.admitted == [] and frontdoor.settled == []


async def test_a_tool_calling_request_gets_its_parser() -> None:
    pipeline, _, _, _ = _pipeline()
    async with await pipeline.open(_request(headers={}, tools=TOOLS)) as run:
        assert run.tool_parser is not None
    async with await pipeline.open(_request("r2", headers={}, tools=TOOLS, tool_choice="none")) as run:
        assert run.tool_parser is None


# ---------------------------------------------------------------- finish -> error


@pytest.mark.parametrize(("reason", "message", "kind", "expected_kind", "expected_message"), [
    (FinishReason.STOP, "", ErrorKind.GENERATION_FAILED, None, ""),
    (FinishReason.LENGTH, "", ErrorKind.GENERATION_FAILED, None, ""),
    (FinishReason.TIMEOUT, "ran past 5s", ErrorKind.GENERATION_FAILED, ErrorKind.TIMEOUT, "ran past 5s"),
    (FinishReason.TIMEOUT, "", ErrorKind.UNAVAILABLE, ErrorKind.TIMEOUT, "the generation ended with timeout"),
    (FinishReason.ERROR, "", ErrorKind.GENERATION_FAILED, ErrorKind.GENERATION_FAILED,
     "the generation ended with error"),
    (FinishReason.ERROR, "engines failed", ErrorKind.UNAVAILABLE, ErrorKind.UNAVAILABLE, "engines failed"),
    (FinishReason.ABORT, "", ErrorKind.GENERATION_FAILED, ErrorKind.GENERATION_FAILED,
     "the generation ended with abort"),
])
def test_finish_reason_to_client_error(
    reason: FinishReason, message: str, kind: ErrorKind, expected_kind: ErrorKind | None, expected_message: str,
) -> None:
    error = finish_error(reason, message, kind)
    if expected_kind is None:
        assert error is None
        return
    assert error is not None
    assert (error.kind, error.message, error.code) == (expected_kind, expected_message, reason.value)
