"""`Scheduler.AdmitMany`: many Admit streams over one call, each meaning
what an Admit call means -- queued / placed / rejected answers, `done` ends
it, the gateway's `end` is a cancelled call, and the call's end ends them
all -- and the gateway's side of it (services/gateway/admit_many.py)."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc

from services.common.proto.kvmesh.v1 import scheduler_pb2 as pb
from services.common.proto.kvmesh.v1 import scheduler_pb2_grpc
from services.gateway.admit_many import AdmitMany

from .test_grpc import TIMEOUT, admit_msg, hello, stack, wait_state

__all__ = ["stack"]   # the fixture (test_grpc.py), used by name


def _frames(*frames: tuple[int, pb.AdmitClientMessage | None, bool]) -> pb.AdmitClientFrames:
    return pb.AdmitClientFrames(frames=[pb.AdmitClientFrame(stream=n, message=m, end=e) for n, m, e in frames])


async def _next(call: grpc.aio.StreamStreamCall, into: dict[int, list[pb.AdmitServerFrame]]) -> None:
    msg: Any = await asyncio.wait_for(call.read(), TIMEOUT)
    for frame in msg.frames:
        into.setdefault(frame.stream, []).append(frame)


async def _engine(stub) -> grpc.aio.StreamStreamCall:
    engine = stub.Connect(timeout=TIMEOUT * 3)
    await engine.write(hello())
    await engine.write(pb.EngineMessage(load=pb.LoadReport(serving=True, blocks_total=1000)))
    await wait_state(stub, lambda s: len(s.engines) == 1 and s.engines[0].serving)
    return engine


async def test_streams_on_one_call_are_queued_placed_and_ended(stack) -> None:
    _service, stub, _ = stack
    call = stub.AdmitMany(timeout=TIMEOUT * 3)
    assert not (await asyncio.wait_for(call.read(), TIMEOUT)).frames   # the call is served
    seen: dict[int, list[pb.AdmitServerFrame]] = {}
    await call.write(_frames((1, admit_msg("a", "x"), False), (2, admit_msg("b", "y"), False)))
    while len(seen) < 2:
        await _next(call, seen)
    assert [f.message.WhichOneof("msg") for f in seen[1] + seen[2]] == ["queued", "queued"]
    # The gateway ends stream 1 (a cancelled call): it leaves the queue.
    await call.write(_frames((1, None, True)))
    state = await wait_state(stub, lambda s: s.queued_total == 1)
    assert [q.tenant for q in state.queues] == ["y"]
    engine = await _engine(stub)
    while not any(f.message.WhichOneof("msg") == "placed" for f in seen[2]):
        await _next(call, seen)
    assert seen[2][-1].message.placed.ends_at_done
    await call.write(_frames((2, pb.AdmitClientMessage(done=pb.RequestDone(completion_tokens=4)), False)))
    while not seen[2][-1].end:
        await _next(call, seen)
    await wait_state(stub, lambda s: s.leases_total == 0)
    # A late frame of an ended stream is dropped; a duplicate id is refused on its own stream only.
    await call.write(_frames((2, pb.AdmitClientMessage(first_token=pb.FirstToken()), False),
                             (3, admit_msg("c"), False), (4, admit_msg("c"), False)))
    while 4 not in seen:
        await _next(call, seen)
    assert seen[4][-1].message.rejected.code == pb.REJECT_CODE_INVALID and seen[4][-1].end
    # The call ends: its streams end as broken Admit calls -- "c"'s lease is
    # kept detached for a resume (detached_leases.py), nothing stays queued.
    call.cancel()
    await wait_state(stub, lambda s: s.leases_total == 1 and s.queued_total == 0)
    engine.cancel()


async def test_the_gateway_side_reads_writes_and_fails_like_admit_calls(stack) -> None:
    service, stub, _ = stack
    engine = await _engine(stub)
    many = AdmitMany(stub.AdmitMany)
    many.ensure()
    async with asyncio.timeout(TIMEOUT):
        while not many.ready:
            await asyncio.sleep(0.01)
    first, second = many.stream(), many.stream()
    assert first is not None and second is not None
    await first.write(admit_msg("g1"))
    await second.write(admit_msg("g2"))
    for stream in (first, second):
        answer: Any = await asyncio.wait_for(stream.read(), TIMEOUT)
        assert answer.WhichOneof("msg") == "placed"
    await first.write(pb.AdmitClientMessage(done=pb.RequestDone(completion_tokens=1)))
    assert await asyncio.wait_for(first.read(), TIMEOUT) is grpc.aio.EOF    # ended at done
    with_callback: list[object] = []
    second.add_done_callback(with_callback.append)
    stop = asyncio.create_task(service.stop(grace=0.5))
    # The scheduler stops: the running stream fails as a broken Admit call would.
    try:
        await asyncio.wait_for(second.read(), TIMEOUT)
        raise AssertionError("the stream outlived the scheduler")
    except grpc.aio.AioRpcError as exc:
        assert exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
    assert with_callback == [second] and not many.ready and many.stream() is None
    await stop
    engine.cancel()
    many.close()


async def test_a_scheduler_without_it_leaves_the_gateway_on_admit_calls() -> None:
    server = grpc.aio.server()
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(scheduler_pb2_grpc.SchedulerServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    many = AdmitMany(scheduler_pb2_grpc.SchedulerStub(channel).AdmitMany)
    try:
        many.ensure()
        async with asyncio.timeout(TIMEOUT):
            while many._task is not None:   # the attempt ends UNIMPLEMENTED
                await asyncio.sleep(0.01)
        assert not many.ready and many.stream() is None
        many.ensure()   # not tried again at once
        assert many._task is None
    finally:
        many.close()
        await channel.close()
        await server.stop(0)


async def test_bytes_that_are_no_frames_are_invalid_argument(stack) -> None:
    _service, _stub, channel = stack
    raw = channel.stream_stream("/kvmesh.v1.Scheduler/AdmitMany")
    call = raw(timeout=TIMEOUT)
    assert await asyncio.wait_for(call.read(), TIMEOUT) == b""   # the empty "served" message
    await call.write(b"\xff\xff\xff")
    assert await asyncio.wait_for(call.code(), TIMEOUT) == grpc.StatusCode.INVALID_ARGUMENT
