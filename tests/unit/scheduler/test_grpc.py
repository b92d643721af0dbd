"""The scheduler over real gRPC, in process, on a free port: a fake engine's
Connect stream, Admit streams queued then placed, cancellation, GetState."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.clock import FakeClock
from services.common.grpc_server import client_options
from services.common.proto.kvmesh.v1 import scheduler_pb2 as pb
from services.common.proto.kvmesh.v1 import scheduler_pb2_grpc
from services.scheduler.server import SchedulerService

from .helpers import make_config

TIMEOUT = 10.0


@pytest.fixture
async def stack() -> AsyncIterator[tuple[SchedulerService, scheduler_pb2_grpc.SchedulerStub, grpc.aio.Channel]]:
    config = make_config(queued_update_seconds=0.1, tick_seconds=0.05)
    service = SchedulerService(config, clock=FakeClock())
    port = await service.start(port=0)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=client_options())
    try:
        yield service, scheduler_pb2_grpc.SchedulerStub(channel), channel
    finally:
        await channel.close()
        await service.stop(grace=0.5)


async def wait_state(
    stub: scheduler_pb2_grpc.SchedulerStub, predicate: Callable[[pb.SchedulerState], bool]
) -> pb.SchedulerState:
    deadline = asyncio.get_running_loop().time() + TIMEOUT
    while True:
        state = await stub.GetState(pb.GetStateRequest(), timeout=TIMEOUT)
        if predicate(state):
            return state
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"state never matched: {state}")
        await asyncio.sleep(0.02)


def admit_msg(rid: str, tenant: str = "t", priority: int = 1) -> pb.AdmitClientMessage:
    return pb.AdmitClientMessage(request=pb.AdmitRequest(
        request_id=rid, model="m", tenant=tenant, priority=priority, prompt_tokens=64,
        max_tokens=16, prefix_hashes=[1, 2, 3, 4]))


def hello(engine_id: str = "eng-1", address: str = "127.0.0.1:1") -> pb.EngineMessage:
    return pb.EngineMessage(hello=pb.EngineHello(
        engine_id=engine_id, address=address, model="m", block_size=16, total_blocks=1000,
        max_running=4, weight=1.0, hash_block_tokens=16, backend="fake"))


async def test_queued_then_placed_then_done(stack) -> None:
    _service, stub, channel = stack
    health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT)
    assert health.status == health_pb2.HealthCheckResponse.SERVING   # serving with zero engines

    call = stub.Admit(timeout=TIMEOUT * 3)
    await call.write(admit_msg("r1", priority=2))
    first = await asyncio.wait_for(call.read(), TIMEOUT)
    assert first.WhichOneof("msg") == "queued" and first.queued.position == 1  # 1 = next, as scheduler.proto says
    assert first.queued.priority == 2
    update = await asyncio.wait_for(call.read(), TIMEOUT)               # periodic position update
    assert update.WhichOneof("msg") == "queued"

    state = await wait_state(stub, lambda s: s.queued_total == 1)
    assert [(q.priority, q.tenant, q.queued) for q in state.queues] == [(2, "t", 1)]
    assert state.policy == "predicted_ttft"

    engine = stub.Connect(timeout=TIMEOUT * 3)
    await engine.write(hello())
    await engine.write(pb.EngineMessage(kv_snapshot=pb.KvSnapshot(seq=0, hashes=[1, 2])))
    await engine.write(pb.EngineMessage(load=pb.LoadReport(serving=True, blocks_total=1000)))

    msg = await asyncio.wait_for(call.read(), TIMEOUT)
    while msg.WhichOneof("msg") == "queued":                              # an update may come first
        msg = await asyncio.wait_for(call.read(), TIMEOUT)
    assert msg.WhichOneof("msg") == "placed"
    assert msg.placed.engine_id == "eng-1" and msg.placed.engine_address == "127.0.0.1:1"
    assert msg.placed.cached_tokens == 32                                 # 2 hash blocks held

    state = await wait_state(stub, lambda s: s.leases_total == 1)
    (eng,) = state.engines
    assert eng.leases == 1 and eng.blocks_reserved > 0 and eng.cached_blocks == 2 and eng.fresh

    # the engine reports the request: its reservation settles
    await engine.write(pb.EngineMessage(load=pb.LoadReport(
        serving=True, blocks_total=1000, blocks_used=5, running=1, request_ids=["r1"])))
    await wait_state(stub, lambda s: s.engines[0].blocks_reserved == 0)

    # a KV seq gap makes the scheduler ask for a snapshot
    await engine.write(pb.EngineMessage(kv_events=pb.KvEvents(seq=3, stored=[9])))
    command = await asyncio.wait_for(engine.read(), TIMEOUT)
    assert command.WhichOneof("cmd") == "resync"

    await call.write(pb.AdmitClientMessage(first_token=pb.FirstToken()))
    await call.write(pb.AdmitClientMessage(done=pb.RequestDone(completion_tokens=16)))
    await call.done_writing()
    assert await asyncio.wait_for(call.read(), TIMEOUT) is grpc.aio.EOF
    await wait_state(stub, lambda s: s.leases_total == 0)

    await engine.done_writing()
    await wait_state(stub, lambda s: not s.engines)
    engine.cancel()


async def test_kv_events_inside_a_load_report_are_applied_before_it(stack) -> None:
    """The scheduler says it reads KV events inside reports; there they
    count as KvEvents messages would: cached blocks, and a seq gap asks for
    a snapshot."""
    _service, stub, _ = stack
    engine = stub.Connect(timeout=TIMEOUT * 3)
    await engine.write(hello("eng-kv"))
    assert ("kvmesh-kv-in-reports", "1") in tuple(await engine.initial_metadata())
    await engine.write(pb.EngineMessage(kv_snapshot=pb.KvSnapshot(seq=0, hashes=[1])))
    await engine.write(pb.EngineMessage(load=pb.LoadReport(serving=True, blocks_total=1000, kv_events=[
        pb.KvEvents(seq=1, stored=[2, 3]), pb.KvEvents(seq=2, stored=[4], removed=[1])])))
    await wait_state(stub, lambda s: len(s.engines) == 1 and s.engines[0].cached_blocks == 3)
    await engine.write(pb.EngineMessage(load=pb.LoadReport(serving=True, blocks_total=1000, kv_events=[
        pb.KvEvents(seq=5, stored=[9])])))
    command = await asyncio.wait_for(engine.read(), TIMEOUT)
    assert command.WhichOneof("cmd") == "resync"
    engine.cancel()


async def test_cancelled_admit_leaves_the_queue(stack) -> None:
    _service, stub, _ = stack
    calls = []
    for rid, tenant in (("a", "x"), ("b", "y")):
        call = stub.Admit(timeout=TIMEOUT * 3)
        await call.write(admit_msg(rid, tenant))
        assert (await asyncio.wait_for(call.read(), TIMEOUT)).WhichOneof("msg") == "queued"
        calls.append(call)
    await wait_state(stub, lambda s: s.queued_total == 2)
    calls[0].cancel()
    state = await wait_state(stub, lambda s: s.queued_total == 1)
    assert [q.tenant for q in state.queues] == ["y"]
    calls[1].cancel()
    await wait_state(stub, lambda s: s.queued_total == 0)


async def test_engine_stream_close_drops_leases(stack) -> None:
    service, stub, _ = stack
    engine = stub.Connect(timeout=TIMEOUT * 3)
    await engine.write(hello("eng-2"))
    await engine.write(pb.EngineMessage(load=pb.LoadReport(serving=True, blocks_total=1000)))
    await wait_state(stub, lambda s: len(s.engines) == 1 and s.engines[0].fresh)
    call = stub.Admit(timeout=TIMEOUT * 3)
    await call.write(admit_msg("r"))
    kinds = []
    while "placed" not in kinds:
        kinds.append((await asyncio.wait_for(call.read(), TIMEOUT)).WhichOneof("msg"))
    engine.cancel()
    await wait_state(stub, lambda s: not s.engines and s.leases_total == 0)
    # The gateway asks for a replacement; no engine is left. It waits for one
    # to come back (engine_return_seconds), then it is rejected.
    await call.write(pb.AdmitClientMessage(replace=pb.Replace(
        exclude_engines=["eng-2"], prompt_tokens=80, max_tokens=8)))
    # (Either order of the clock and the replace ends so; the wait itself is
    # test_engine_identity.py's.)
    service.clock.advance(service.config.scheduler.engine_return_seconds + 1)
    msg = await asyncio.wait_for(call.read(), TIMEOUT)
    assert msg.WhichOneof("msg") == "rejected"
    assert msg.rejected.code == pb.REJECT_CODE_NO_ENGINE
    assert await asyncio.wait_for(call.read(), TIMEOUT) is grpc.aio.EOF


async def test_protocol_errors_get_clear_status(stack) -> None:
    _, stub, _ = stack
    engine = stub.Connect(timeout=TIMEOUT)
    bad = hello()
    bad.hello.block_size = 10
    await engine.write(bad)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await engine.read()
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "block_size" in info.value.details()

    call = stub.Admit(timeout=TIMEOUT)
    await call.write(pb.AdmitClientMessage(first_token=pb.FirstToken()))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call.read()
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    call = stub.Admit(timeout=TIMEOUT)
    await call.write(admit_msg("bad", priority=7))
    msg = await call.read()
    assert msg.rejected.code == pb.REJECT_CODE_INVALID and "priority" in msg.rejected.message
    assert await call.read() is grpc.aio.EOF


async def test_an_id_connected_from_another_address_is_refused(stack) -> None:
    """Two engines configured with one id: the second is refused with
    ALREADY_EXISTS while the first is connected, and the first keeps its
    registration; the same id from the same address (a restarted engine whose
    old stream has not ended yet) replaces it; once the id is free, anyone may
    take it."""
    _, stub, _ = stack
    first = stub.Connect(timeout=TIMEOUT * 3)
    await first.write(hello("eng-1", "127.0.0.1:1"))
    await first.write(pb.EngineMessage(load=pb.LoadReport(serving=True, blocks_total=1000)))
    await wait_state(stub, lambda s: len(s.engines) == 1 and s.engines[0].fresh)

    twin = stub.Connect(timeout=TIMEOUT)
    await twin.write(hello("eng-1", "127.0.0.1:2"))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await twin.read()
    assert info.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert "already connected from 127.0.0.1:1" in info.value.details()
    # The first engine is still the one registered, and its reports still count.
    await first.write(pb.EngineMessage(load=pb.LoadReport(serving=True, blocks_total=1000, running=3)))
    state = await wait_state(stub, lambda s: len(s.engines) == 1 and s.engines[0].running == 3)
    assert state.engines[0].address == "127.0.0.1:1"

    restarted = stub.Connect(timeout=TIMEOUT * 3)
    await restarted.write(hello("eng-1", "127.0.0.1:1"))
    await restarted.write(pb.EngineMessage(load=pb.LoadReport(serving=True, blocks_total=1000, running=1)))
    await wait_state(stub, lambda s: len(s.engines) == 1 and s.engines[0].running == 1)
    first.cancel()
    restarted.cancel()
    await wait_state(stub, lambda s: not s.engines)

    moved = stub.Connect(timeout=TIMEOUT * 3)
    await moved.write(hello("eng-1", "127.0.0.1:2"))
    await moved.write(pb.EngineMessage(load=pb.LoadReport(serving=True, blocks_total=1000)))
    state = await wait_state(stub, lambda s: len(s.engines) == 1 and s.engines[0].fresh)
    assert state.engines[0].address == "127.0.0.1:2"
    moved.cancel()


async def test_stop_rejects_queued_with_draining(stack) -> None:
    service, stub, _ = stack
    call = stub.Admit(timeout=TIMEOUT * 3)
    await call.write(admit_msg("r"))
    assert (await asyncio.wait_for(call.read(), TIMEOUT)).WhichOneof("msg") == "queued"
    stop = asyncio.create_task(service.stop(grace=1.0))
    msg = await asyncio.wait_for(call.read(), TIMEOUT)
    while msg.WhichOneof("msg") == "queued":
        msg = await asyncio.wait_for(call.read(), TIMEOUT)
    assert msg.rejected.code == pb.REJECT_CODE_DRAINING
    await stop


async def test_drain_command_reaches_engine_and_stops_placement(stack) -> None:
    service, stub, _ = stack
    engine = stub.Connect(timeout=TIMEOUT * 3)
    await engine.write(hello("eng-3"))
    await engine.write(pb.EngineMessage(load=pb.LoadReport(serving=True, blocks_total=1000)))
    await wait_state(stub, lambda s: len(s.engines) == 1 and s.engines[0].fresh)
    assert service.drain_engine("eng-3")
    command = await asyncio.wait_for(engine.read(), TIMEOUT)
    assert command.WhichOneof("cmd") == "drain"
    state = await wait_state(stub, lambda s: s.engines[0].draining)
    call = stub.Admit(timeout=TIMEOUT * 3)
    await call.write(admit_msg("r"))
    assert (await asyncio.wait_for(call.read(), TIMEOUT)).WhichOneof("msg") == "queued"
    state = await stub.GetState(pb.GetStateRequest(), timeout=TIMEOUT)
    assert state.queued_total == 1 and state.leases_total == 0
    call.cancel()
    engine.cancel()


async def test_measured_step_speed_reaches_get_state(stack) -> None:
    """LoadReport 310-311 (the engine's measured prefill speed and step
    time) are read into the fleet's view and shown by GetState."""
    _, stub, _ = stack
    engine = stub.Connect(timeout=TIMEOUT * 3)
    await engine.write(hello("eng-4"))
    await engine.write(pb.EngineMessage(load=pb.LoadReport(
        serving=True, blocks_total=1000, prefill_tokens_per_second=4700.0, step_seconds=0.04, step_token_budget=512)))
    state = await wait_state(stub, lambda s: len(s.engines) == 1 and s.engines[0].fresh)
    assert (state.engines[0].prefill_tokens_per_second, state.engines[0].step_seconds) == (4700.0, 0.04)
    engine.cancel()


async def test_serve_runs_until_cancelled() -> None:
    from services.scheduler.server import serve

    config = make_config()
    config.scheduler.port = 0
    task = asyncio.create_task(serve(config))
    await asyncio.sleep(0.2)
    assert not task.done()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_admit_call_opened_ahead_is_placed_later_and_ended_on_stop(stack) -> None:
    """A gateway opens its next Admit call before it needs it: the request it
    sends later is handled as usual, and a call still unused when the
    scheduler stops ends at once (no grace period spent waiting on it)."""
    service, stub, _ = stack
    ahead = stub.Admit(timeout=TIMEOUT * 3)
    await asyncio.sleep(0.2)  # the handler is waiting for the first message
    await ahead.write(admit_msg("late"))
    assert (await asyncio.wait_for(ahead.read(), TIMEOUT)).WhichOneof("msg") in ("queued", "rejected")
    ahead.cancel()
    unused = stub.Admit(timeout=TIMEOUT * 6)
    waiting = service.servicer._idle_calls._waiting
    async with asyncio.timeout(TIMEOUT):
        while not waiting:
            await asyncio.sleep(0.01)
    # A grace far longer than the timeouts below: only ending the unused call
    # at once lets stop() and the call finish in time.
    stop = asyncio.create_task(service.stop(grace=TIMEOUT * 5))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await asyncio.wait_for(unused.read(), TIMEOUT)
    assert info.value.code() in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE)
    await asyncio.wait_for(stop, TIMEOUT * 2)


async def test_a_taken_port_fails_to_start_instead_of_sharing_it() -> None:
    """gRPC would bind with SO_REUSEPORT and let two servers split one port's
    connections; a second server on a taken port must fail instead."""
    first = SchedulerService(make_config(), clock=FakeClock())
    port = await first.start(port=0)
    second = SchedulerService(make_config(), clock=FakeClock())
    try:
        with pytest.raises((OSError, RuntimeError)):
            await second.start(port=port)
    finally:
        await second.stop(grace=0.1)
        await first.stop(grace=0.1)


async def _read_until(call: grpc.aio.StreamStreamCall, kind: str) -> pb.AdmitServerMessage:
    """The next message of `kind`, skipping Queued position updates."""
    while True:
        msg = await asyncio.wait_for(call.read(), TIMEOUT)
        if msg.WhichOneof("msg") != "queued":
            assert msg.WhichOneof("msg") == kind, msg
            return msg


async def test_preempted_then_requeued_then_placed_again() -> None:
    """A fake gateway's P2 Admit stream gets Preempted when a P0 takes the
    engine's only slot, answers Requeue, and is Placed again once the P0 is
    done; GetState counts it per class."""
    config = make_config(queued_update_seconds=0.1, tick_seconds=0.05,
                         engine_queue_slack=0, p0_reserved_leases=0)
    service = SchedulerService(config, clock=FakeClock())
    port = await service.start(port=0)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=client_options())
    stub = scheduler_pb2_grpc.SchedulerStub(channel)
    try:
        engine = stub.Connect(timeout=TIMEOUT * 3)
        one_slot = hello("eng-1")
        one_slot.hello.max_running = 1
        await engine.write(one_slot)
        await engine.write(pb.EngineMessage(load=pb.LoadReport(serving=True, blocks_total=1000)))
        await wait_state(stub, lambda s: len(s.engines) == 1 and s.engines[0].fresh)

        batch = stub.Admit(timeout=TIMEOUT * 3)
        await batch.write(admit_msg("b", tenant="batch", priority=2))
        assert (await _read_until(batch, "placed")).placed.engine_id == "eng-1"

        chat = stub.Admit(timeout=TIMEOUT * 3)
        await chat.write(admit_msg("chat", tenant="web", priority=0))
        assert (await _read_until(chat, "placed")).placed.engine_id == "eng-1"
        preempted = (await _read_until(batch, "preempted")).preempted
        assert (preempted.engine_id, preempted.preemptions, preempted.by_priority) == ("eng-1", 1, 0)

        await batch.write(pb.AdmitClientMessage(requeue=pb.Requeue(
            prompt_tokens=80, max_tokens=4, prefix_hashes=[1, 2, 3, 4, 5])))
        await wait_state(stub, lambda s: s.queued_total == 1)
        await chat.write(pb.AdmitClientMessage(done=pb.RequestDone(completion_tokens=16)))
        await chat.done_writing()
        assert (await _read_until(batch, "placed")).placed.engine_id == "eng-1"

        state = await wait_state(stub, lambda s: s.leases_total == 1)
        classes = {c.priority: c for c in state.classes}
        assert sorted(classes) == [0, 1, 2]
        p2 = classes[2]
        assert (p2.preemptions, p2.requeued, p2.preempted_now, p2.displaced, p2.protected) == (1, 1, 0, 0, 0)
        assert classes[0].preemptions == 0
        batch.cancel()
        engine.cancel()
    finally:
        await channel.close()
        await service.stop(grace=0.5)


async def test_a_resume_takes_a_request_over_from_its_old_stream(stack) -> None:
    """Resume (detached_leases.py) over real streams: a broken Admit stream
    leaves the lease DETACHED; a resume re-attaches it; a second resume takes
    it over while the first is still open (which ends without touching it)."""
    _service, stub, _ = stack
    engine = stub.Connect(timeout=TIMEOUT * 3)
    await engine.write(hello("eng-r", "127.0.0.1:7"))
    await engine.write(pb.EngineMessage(load=pb.LoadReport(serving=True, blocks_total=1000)))
    await wait_state(stub, lambda s: len(s.engines) == 1 and s.engines[0].fresh)

    async def placed(call: grpc.aio.StreamStreamCall) -> pb.Placed:
        while True:
            msg = await asyncio.wait_for(call.read(), TIMEOUT)
            assert msg.WhichOneof("msg") in ("queued", "placed"), msg
            if msg.WhichOneof("msg") == "placed":
                return msg.placed

    def resume_msg(tenant: str = "t") -> pb.AdmitClientMessage:
        msg = admit_msg("rr", tenant=tenant)
        msg.request.resume = True
        return msg

    first = stub.Admit(timeout=TIMEOUT * 3)
    await first.write(admit_msg("rr"))
    lease = (await placed(first)).lease_id
    first.cancel()  # the gateway vanished: the lease is kept
    await asyncio.sleep(0.2)
    assert (await stub.GetState(pb.GetStateRequest(), timeout=TIMEOUT)).leases_total == 1
    intruder = stub.Admit(timeout=TIMEOUT * 3)
    await intruder.write(resume_msg("other"))
    refused = await asyncio.wait_for(intruder.read(), TIMEOUT)
    assert refused.rejected.code == pb.REJECT_CODE_RESUME_FORBIDDEN
    second = stub.Admit(timeout=TIMEOUT * 3)
    await second.write(resume_msg())
    again = await placed(second)
    assert (again.engine_id, again.engine_address, again.lease_id) == ("eng-r", "127.0.0.1:7", lease)
    third = stub.Admit(timeout=TIMEOUT * 3)  # the second is still open: taken over
    await third.write(resume_msg())
    assert (await placed(third)).lease_id == lease
    assert await asyncio.wait_for(second.read(), TIMEOUT) is grpc.aio.EOF  # the old stream ends
    assert (await stub.GetState(pb.GetStateRequest(), timeout=TIMEOUT)).leases_total == 1
    await third.write(pb.AdmitClientMessage(done=pb.RequestDone(finish_reason="stop")))
    await wait_state(stub, lambda s: s.leases_total == 0)
    engine.cancel()
