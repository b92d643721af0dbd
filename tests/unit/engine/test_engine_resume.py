"""Stream resumption, engine side (services/engine/detached.py): a call
that breaks without a polite `cancel` leaves its generation DETACHED --
still generating, outputs kept -- for `resume.grace_seconds`; a `resume`
call replays every delta from the first, then continues live; a second
resume takes over from the first; the grace ends it (KV freed)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest
from engine_helpers import engine_config, engine_stub, mesh_config, prompt_of, started
from test_grpc_service import collect, gen_request, wait_until

from services.common.proto.kvmesh.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from services.engine.server import EngineService


@pytest.fixture
async def service() -> AsyncIterator[EngineService]:
    engine = engine_config()
    engine.sim.speed_factor = 0.05  # a few hundred tokens take a moment
    config = mesh_config()
    config.resume.grace_seconds = 30.0
    async with started(EngineService(config, engine)) as svc:
        yield svc


@pytest.fixture
async def stub(service: EngineService) -> AsyncIterator[engine_pb2_grpc.EngineStub]:
    async with engine_stub(service) as client:
        yield client


def resume_message(rid: str, prompt: list[int]) -> engine_pb2.EngineGenerateMessage:
    return engine_pb2.EngineGenerateMessage(
        resume=engine_pb2.ResumeGeneration(request_id=rid, prompt_token_ids=prompt))


async def uninterrupted(stub: engine_pb2_grpc.EngineStub, rid: str, prompt: list[int], n: int
                        ) -> tuple[list[int], str, engine_pb2.EngineFinished]:
    call = stub.Generate()
    await call.write(gen_request(rid, prompt, n))
    return await collect(call)


async def read_deltas(
    call: grpc.aio.StreamStreamCall[engine_pb2.EngineGenerateMessage, engine_pb2.EngineGenerateEvent], count: int,
) -> list[engine_pb2.EngineDelta]:
    out: list[engine_pb2.EngineDelta] = []
    while len(out) < count:
        event = await call.read()
        assert event.HasField("delta")  # type: ignore[attr-defined]  # grpc-stubs type read() as object (its EOF's type)
        out.append(event.delta)  # type: ignore[attr-defined]  # grpc-stubs type read() as object (its EOF's type)
    return out


async def test_a_broken_call_detaches_and_a_resume_replays_then_continues(
        service: EngineService, stub: engine_pb2_grpc.EngineStub) -> None:
    prompt = prompt_of(24)
    want_ids, want_text, want_done = await uninterrupted(stub, "ref", prompt, 300)
    call = stub.Generate()
    await call.write(gen_request("r1", prompt, 300, delta_offset=7))
    got = await read_deltas(call, 3)
    call.cancel()  # no `cancel` message: the gateway vanished
    await wait_until(lambda: service.runtime.kept.detached_count == 1)
    assert service.runtime.live_count == 1
    # Still generating while detached: wait until it has finished in the backend.
    await wait_until(lambda: service.backend.load().running == 0, timeout=30)
    resumed = stub.Generate()
    await resumed.write(resume_message("r1", prompt))
    first = await resumed.read()
    assert first.HasField("resumed") and first.resumed.delta_offset == 7
    assert list(first.resumed.prior_token_ids) == []
    ids, text, done = await collect(resumed)
    # Replayed from the first delta: the whole generation, exactly once.
    assert ids == want_ids and text == want_text
    assert [t for d in got for t in d.token_ids] == ids[:sum(len(d.token_ids) for d in got)]
    assert done.usage.completion_tokens == want_done.usage.completion_tokens == 300
    assert done.finish_reason == want_done.finish_reason
    await wait_until(lambda: service.runtime.live_count == 0)
    assert service.runtime.kept.detached_count == 0


async def test_a_polite_cancel_ends_at_once(service: EngineService, stub: engine_pb2_grpc.EngineStub) -> None:
    call = stub.Generate()
    await call.write(gen_request("p1", prompt_of(24), 3000))
    await read_deltas(call, 1)
    await call.write(engine_pb2.EngineGenerateMessage(cancel=engine_pb2.CancelGeneration()))
    _, _, done = await collect(call)
    assert done.finish_reason == common_pb2.FINISH_REASON_ABORT
    await wait_until(lambda: service.runtime.live_count == 0)
    assert service.runtime.kept.detached_count == 0
    resumed = stub.Generate()
    await resumed.write(resume_message("p1", prompt_of(24)))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await resumed.read()
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


async def test_the_grace_expires_a_detached_generation(service: EngineService,
                                                       stub: engine_pb2_grpc.EngineStub) -> None:
    service.runtime.kept.grace_seconds = 0.2
    call = stub.Generate()
    await call.write(gen_request("x1", prompt_of(24), 3000))
    await read_deltas(call, 1)
    call.cancel()
    await wait_until(lambda: service.runtime.live_count == 0, timeout=10)
    assert service.backend.load().blocks_used == 0
    resumed = stub.Generate()
    await resumed.write(resume_message("x1", prompt_of(24)))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await resumed.read()
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


async def test_a_resume_with_another_prompt_is_refused(stub: engine_pb2_grpc.EngineStub) -> None:
    call = stub.Generate()
    await call.write(gen_request("w1", prompt_of(24), 3000))
    await read_deltas(call, 1)
    call.cancel()
    resumed = stub.Generate()
    await resumed.write(resume_message("w1", prompt_of(25)))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await resumed.read()
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    again = stub.Generate()  # the right prompt still resumes it
    await again.write(resume_message("w1", prompt_of(24)))
    assert (await again.read()).HasField("resumed")
    await again.write(engine_pb2.EngineGenerateMessage(cancel=engine_pb2.CancelGeneration()))


async def test_a_second_resume_takes_over_and_the_first_call_ends_aborted(
        service: EngineService, stub: engine_pb2_grpc.EngineStub) -> None:
    prompt = prompt_of(24)
    want_ids, _, _ = await uninterrupted(stub, "ref2", prompt, 400)
    first = stub.Generate()
    await first.write(gen_request("t1", prompt, 400))
    await read_deltas(first, 2)
    # The first call is still attached (a partitioned gateway): take it over.
    second = stub.Generate()
    await second.write(resume_message("t1", prompt))
    assert (await second.read()).HasField("resumed")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        while True:
            event = await first.read()
            assert event is not grpc.aio.EOF and not event.HasField("finished")
    assert err.value.code() == grpc.StatusCode.ABORTED
    ids, _, done = await collect(second)
    assert ids == want_ids and done.finish_reason == common_pb2.FINISH_REASON_LENGTH
    await wait_until(lambda: service.runtime.live_count == 0)


async def test_detached_generations_end_when_the_engine_stops(service: EngineService,
                                                             stub: engine_pb2_grpc.EngineStub) -> None:
    call = stub.Generate()
    await call.write(gen_request("s1", prompt_of(24), 3000))
    await read_deltas(call, 1)
    call.cancel()
    await wait_until(lambda: service.runtime.kept.detached_count == 1)
    await service.runtime.stop(grace_seconds=5.0)  # not held for the resume grace
    assert service.runtime.live_count == 0


async def test_a_finished_generation_is_kept_until_the_gateway_acknowledges_it(
        service: EngineService, stub: engine_pb2_grpc.EngineStub) -> None:
    """A gateway relays behind its engine: when it dies after the engine's
    `finished` but before its client had the last events, a resume must still
    find the generation. With `ack_final`, a call that breaks before the
    acknowledgement keeps it; an acknowledged one is forgotten at once."""
    prompt = prompt_of(24)
    want_ids, want_text, _ = await uninterrupted(stub, "ref-ack", prompt, 40)

    acked = stub.Generate()
    await acked.write(gen_request("acked", prompt, 40, ack_final=True))
    await collect(acked)
    await acked.write(engine_pb2.EngineGenerateMessage(cancel=engine_pb2.CancelGeneration()))
    await acked.done_writing()
    assert await acked.code() == grpc.StatusCode.OK
    await wait_until(lambda: service.runtime.live_count == 0)
    assert service.runtime.kept.detached_count == 0

    broken = stub.Generate()
    await broken.write(gen_request("broken", prompt, 40, ack_final=True))
    await collect(broken)
    broken.cancel()  # the gateway died before its client had everything
    await wait_until(lambda: service.runtime.kept.detached_count == 1)
    resumed = stub.Generate()
    await resumed.write(resume_message("broken", prompt))
    assert (await resumed.read()).HasField("resumed")
    ids, text, done = await collect(resumed)
    assert (ids, text) == (want_ids, want_text)
    assert done.finish_reason == common_pb2.FINISH_REASON_LENGTH
