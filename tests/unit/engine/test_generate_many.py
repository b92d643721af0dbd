"""`Engine.GenerateMany`: many Generate streams over one call, each meaning
exactly what a Generate call means. The Generate call tests of
test_grpc_service.py and test_engine_resume.py run here again with every
"call" a stream on one GenerateMany call (the gateway's side of it,
services/gateway/generate_many.py); then what is the call's own: the end of
the call breaks every stream on it (kept detached for a resume), a `cancel`
right before the gateway's `end` is still polite, and a gateway falls back
to Generate calls against an engine without it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any, cast

import grpc
import pytest
from engine_helpers import engine_stub, prompt_of
from test_engine_resume import (
    resume_message,
    service,
    test_a_broken_call_detaches_and_a_resume_replays_then_continues,
    test_a_finished_generation_is_kept_until_the_gateway_acknowledges_it,
    test_a_polite_cancel_ends_at_once,
    test_a_resume_with_another_prompt_is_refused,
    test_a_second_resume_takes_over_and_the_first_call_ends_aborted,
    test_detached_generations_end_when_the_engine_stops,
    test_the_grace_expires_a_detached_generation,
)
from test_grpc_service import (
    collect,
    gen_request,
    test_a_placement_racing_its_old_calls_cancel_waits_for_it,
    test_abort_rpc,
    test_cancel_message_aborts_and_frees_blocks,
    test_client_cancelling_the_call_frees_blocks_after_the_resume_grace,
    test_draining_refuses_new_work_but_finishes_running,
    test_duplicate_request_id,
    test_generate_streams_then_finishes_with_usage,
    test_invalid_argument,
    test_placing_a_request_again_ends_its_stale_generation,
    test_slow_reader_gets_every_token,
    wait_until,
)

from services.common.proto.kvmesh.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from services.engine.server import EngineService
from services.gateway.engine_client import EnginePool
from services.gateway.generate_many import GenerateMany
from services.gateway.many_call import ManyStream

# The Generate call tests above, collected here again on streams.
__all__ = [
    "service",   # the fixture (test_engine_resume.py: resume grace 30 s), used by name
    "test_a_broken_call_detaches_and_a_resume_replays_then_continues",
    "test_a_finished_generation_is_kept_until_the_gateway_acknowledges_it",
    "test_a_placement_racing_its_old_calls_cancel_waits_for_it",
    "test_a_polite_cancel_ends_at_once",
    "test_a_resume_with_another_prompt_is_refused",
    "test_a_second_resume_takes_over_and_the_first_call_ends_aborted",
    "test_abort_rpc",
    "test_cancel_message_aborts_and_frees_blocks",
    "test_client_cancelling_the_call_frees_blocks_after_the_resume_grace",
    "test_detached_generations_end_when_the_engine_stops",
    "test_draining_refuses_new_work_but_finishes_running",
    "test_duplicate_request_id",
    "test_generate_streams_then_finishes_with_usage",
    "test_invalid_argument",
    "test_placing_a_request_again_ends_its_stale_generation",
    "test_slow_reader_gets_every_token",
    "test_the_grace_expires_a_detached_generation",
]

TIMEOUT = 10.0


class _ManyStub:
    """An EngineStub whose `Generate()` is a stream on one GenerateMany call."""

    def __init__(self, stub: engine_pb2_grpc.EngineStub) -> None:
        self._stub = stub
        self.many = GenerateMany(stub.GenerateMany)

    def Generate(self, *_args: Any, **_kwargs: Any) -> Any:  # noqa: N802 - the stub's method name
        stream = self.many.stream()
        assert stream is not None, "the GenerateMany call is not up"
        return stream

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stub, name)


async def _ready(many: GenerateMany) -> None:
    many.ensure()
    async with asyncio.timeout(TIMEOUT):
        while not many.ready:
            await asyncio.sleep(0.005)


@pytest.fixture
async def stub(service: EngineService) -> AsyncIterator[_ManyStub]:
    async with engine_stub(service) as client:
        many_stub = _ManyStub(client)
        await _ready(many_stub.many)
        try:
            yield many_stub
        finally:
            many_stub.many.close()


async def test_the_call_ending_breaks_every_stream_and_keeps_them_for_a_resume(
        service: EngineService, stub: _ManyStub) -> None:
    first, second = stub.Generate(), stub.Generate()
    await first.write(gen_request("m1", prompt_of(20), 3000))
    await second.write(gen_request("m2", prompt_of(24), 3000))
    for stream in (first, second):
        event: Any = await asyncio.wait_for(stream.read(), TIMEOUT)
        assert event.HasField("delta")
    stub.many.close()   # the gateway's call breaks (the gateway died, its link did)
    for stream in (first, second):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await asyncio.wait_for(stream.read(), TIMEOUT)
        assert err.value.code() in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE)
    await wait_until(lambda: len(service.runtime.kept._timers) == 2)   # detached, still generating
    # A new call: a resume on it replays the kept generation and goes on.
    again = _ManyStub(stub._stub)
    await _ready(again.many)
    resumed = again.Generate()
    await resumed.write(resume_message("m1", prompt_of(20)))
    event = await asyncio.wait_for(resumed.read(), TIMEOUT)
    assert event.HasField("resumed")
    await resumed.write(engine_pb2.EngineGenerateMessage(cancel=engine_pb2.CancelGeneration()))
    _, _, finished = await asyncio.wait_for(collect(cast(Any, resumed)), TIMEOUT)
    assert finished.finish_reason == common_pb2.FINISH_REASON_ABORT
    assert await asyncio.wait_for(resumed.code(), TIMEOUT) == grpc.StatusCode.OK
    again.many.close()


async def test_cancel_then_end_is_polite_and_frees_at_once(service: EngineService, stub: _ManyStub) -> None:
    """The gateway's `abort`: `cancel`, then the stream ended at once -- in
    one message. The engine reads the `cancel` first: ended, not kept."""
    stream = stub.Generate()
    await stream.write(gen_request("p", prompt_of(20), 3000))
    event: Any = await asyncio.wait_for(stream.read(), TIMEOUT)
    assert event.HasField("delta")
    await stream.write(engine_pb2.EngineGenerateMessage(cancel=engine_pb2.CancelGeneration()))
    stream.cancel()
    await wait_until(lambda: service.runtime.live_count == 0)
    assert not service.runtime.kept._timers and service.backend.load().blocks_used == 0


async def test_an_error_ends_only_its_stream(stub: _ManyStub) -> None:
    bad, good = stub.Generate(), stub.Generate()
    await bad.write(gen_request("bad", [], 5))
    await good.write(gen_request("good", prompt_of(8), 5))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await asyncio.wait_for(bad.read(), TIMEOUT)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert await bad.code() == grpc.StatusCode.INVALID_ARGUMENT
    ids, _, _ = await asyncio.wait_for(collect(cast(Any, good)), TIMEOUT)
    assert len(ids) == 5 and stub.many.ready


async def test_the_pool_uses_the_call_once_up_and_generate_calls_before(service: EngineService) -> None:
    pool = EnginePool()
    address = f"127.0.0.1:{service.port}"
    try:
        first = pool.open(address, "e")   # the call is not up yet: a Generate call
        assert not isinstance(first._call, ManyStream)
        await _ready(pool._many[address])
        second = pool.open(address, "e")
        assert isinstance(second._call, ManyStream)
        for stream, rid in ((first, "pool-1"), (second, "pool-2")):
            await stream.start(gen_request(rid, prompt_of(8), 4).request)
            events = [e async for e in stream.events()]
            assert events[-1].HasField("finished")
            await stream.close()
        await wait_until(lambda: service.runtime.live_count == 0)
    finally:
        await pool.close()


async def _first_try_fails(servicer: engine_pb2_grpc.EngineServicer, tag: str) -> float:
    """A gateway's pool against an engine that will not serve GenerateMany:
    the first attempt ends, the next request goes on a Generate call (not
    tried again at once). Returns seconds until the call is tried again."""
    server = grpc.aio.server()
    engine_pb2_grpc.add_EngineServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    pool = EnginePool()
    address = f"127.0.0.1:{port}"
    try:
        pool.open(address, tag).cancel()
        many = pool._many[address]
        async with asyncio.timeout(TIMEOUT):
            while many._task is not None:   # the attempt ends
                await asyncio.sleep(0.01)
        assert not many.ready
        retry_in = many._retry_at - asyncio.get_running_loop().time()
        stream = pool.open(address, tag)   # not tried again at once: a Generate call
        assert not isinstance(stream._call, ManyStream) and many._task is None
        stream.cancel()
        return retry_in
    finally:
        await pool.close()
        await server.stop(0)


async def test_an_engine_without_it_leaves_the_gateway_on_generate_calls() -> None:
    await _first_try_fails(engine_pb2_grpc.EngineServicer(), "old")   # UNIMPLEMENTED


class _RefusingEngine(engine_pb2_grpc.EngineServicer):
    """An engine whose mesh TLS policy does not list GenerateMany for gateways."""

    async def GenerateMany(self, request_iterator: object, context: grpc.aio.ServicerContext) -> None:  # noqa: N802 - the proto's method name
        await context.abort(grpc.StatusCode.PERMISSION_DENIED, "GenerateMany is for no certificate of yours")


async def test_a_refused_call_is_not_tried_again_at_once() -> None:
    """PERMISSION_DENIED is an engine that will not serve the call (as
    UNIMPLEMENTED), not a broken call: Generate calls until the long retry."""
    assert await _first_try_fails(_RefusingEngine(), "refused") > 10.0   # the long retry, not the 1 s one
