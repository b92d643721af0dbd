"""A scheduler that goes silent (a host cut off without a reset, a stopped
or wedged process) seen from the gateway's AdmitMany call
(services/gateway/many_call.py `answer_seconds`) and its replicas
(scheduler_replicas.py): a call that owes an answer and hears nothing for
the bound fails like a broken one, so its requests move; a busy scheduler
whose answers come late but keep coming is not silent; a silent replica is
passed over until it answers a GetState again."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import pytest
from conftest import MODEL, _serve

from services.common.proto.kvmesh.v1 import scheduler_pb2 as pb
from services.common.proto.kvmesh.v1 import scheduler_pb2_grpc
from services.gateway.admit_many import AdmitMany
from services.gateway.scheduler_replicas import SchedulerReplicas, rendezvous_order

TIMEOUT = 10.0
BOUND = 0.3


class _Scheduler(scheduler_pb2_grpc.SchedulerServicer):
    """AdmitMany that answers each request `Queued` after `delay` s, one after
    the other -- or nothing at all while `silent`, and GetState hangs then."""

    def __init__(self) -> None:
        self.silent = False
        self.delay = 0.0
        self.answered = 0

    async def AdmitMany(self, request_iterator: object, context: grpc.aio.ServicerContext) -> None:  # noqa: N802
        await context.write(pb.AdmitServerFrames())   # the call is served
        answers: asyncio.Queue[int] = asyncio.Queue()

        async def answer() -> None:
            while True:
                stream = await answers.get()
                await asyncio.sleep(self.delay)
                while self.silent:
                    await asyncio.sleep(0.05)
                await context.write(pb.AdmitServerFrames(frames=[pb.AdmitServerFrame(
                    stream=stream, message=pb.AdmitServerMessage(queued=pb.Queued(position=1)))]))
                self.answered += 1

        writer = asyncio.create_task(answer())
        try:
            while (message := await context.read()) is not grpc.aio.EOF:
                frames: Any = message
                for frame in frames.frames:
                    if frame.HasField("message") and frame.message.HasField("request"):
                        answers.put_nowait(frame.stream)   # answered once not silent (a stopped process)
        finally:
            writer.cancel()

    async def GetState(self, request: pb.GetStateRequest,  # noqa: N802 - the proto's method name
                       context: grpc.aio.ServicerContext) -> pb.SchedulerState:
        while self.silent:
            await asyncio.sleep(0.05)
        return pb.SchedulerState(engines=[pb.EngineState(engine_id="engine-0", model=MODEL, fresh=True)])


async def _scheduler(servicer: _Scheduler) -> tuple[grpc.aio.Server, str]:
    return await _serve(scheduler_pb2_grpc.add_SchedulerServicer_to_server, servicer)


def _request(request_id: str) -> pb.AdmitClientMessage:
    return pb.AdmitClientMessage(request=pb.AdmitRequest(request_id=request_id, model=MODEL, tenant="t",
                                                          prompt_tokens=4, max_tokens=4))


async def _until(predicate: Callable[[], bool], seconds: float = TIMEOUT) -> None:
    async with asyncio.timeout(seconds):
        while not predicate():
            await asyncio.sleep(0.01)


@pytest.fixture
async def served() -> AsyncIterator[tuple[_Scheduler, scheduler_pb2_grpc.SchedulerStub, list[int]]]:
    fake = _Scheduler()
    server, address = await _scheduler(fake)
    channel = grpc.aio.insecure_channel(address)
    silences: list[int] = []
    try:
        yield fake, scheduler_pb2_grpc.SchedulerStub(channel), silences
    finally:
        await channel.close()
        await server.stop(0)


async def _ready(many: AdmitMany) -> None:
    many.ensure()
    await _until(lambda: many.ready)


async def test_a_call_that_owes_an_answer_and_hears_nothing_fails_like_a_broken_one(served) -> None:
    fake, stub, silences = served
    many = AdmitMany(stub.AdmitMany, BOUND, lambda: silences.append(1))
    await _ready(many)
    first = many.stream()
    assert first is not None
    await first.write(_request("a"))
    answer: Any = await asyncio.wait_for(first.read(), TIMEOUT)
    assert answer.WhichOneof("msg") == "queued"
    fake.silent = True
    second = many.stream()
    assert second is not None
    began = asyncio.get_running_loop().time()
    await second.write(_request("b"))
    for stream in (second, first):   # the whole call: the running stream moves too
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await asyncio.wait_for(stream.read(), TIMEOUT)
        assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "said nothing" in (failed.value.details() or "")
    assert asyncio.get_running_loop().time() - began >= BOUND
    assert silences == [1]
    many.close()


async def test_a_busy_scheduler_answering_late_but_answering_is_not_silent(served) -> None:
    """Each answer comes 0.15 s after the last, so the later requests wait
    far past the bound -- while the call keeps hearing from the scheduler."""
    fake, stub, silences = served
    fake.delay = 0.15
    many = AdmitMany(stub.AdmitMany, BOUND, lambda: silences.append(1))
    await _ready(many)
    streams = []
    for i in range(12):
        stream = many.stream()
        assert stream is not None
        await stream.write(_request(f"r{i}"))
        streams.append(stream)
        await asyncio.sleep(0.05)
    for stream in streams:
        answer: Any = await asyncio.wait_for(stream.read(), TIMEOUT)
        assert answer.WhichOneof("msg") == "queued"
    assert fake.answered == 12 and silences == [] and many.ready
    many.close()


async def test_a_gateway_whose_own_loop_stalled_reads_before_it_judges(served) -> None:
    """The answer came while this loop was blocked past the bound: it waits
    unread behind the watch, which must not call the scheduler silent."""
    _fake, stub, silences = served
    many = AdmitMany(stub.AdmitMany, BOUND, lambda: silences.append(1))
    await _ready(many)
    for i in range(5):
        stream = many.stream()
        assert stream is not None
        await stream.write(_request(f"s{i}"))
        time.sleep(2 * BOUND)   # the stall under test: the loop blocked
        answer: Any = await asyncio.wait_for(stream.read(), TIMEOUT)
        assert answer.WhichOneof("msg") == "queued"
    assert silences == [] and many.ready
    many.close()


async def test_no_bound_no_watch(served) -> None:
    """`answer_seconds` 0 (network.silent_peer_seconds: 0): a silent
    scheduler is left to keepalive, as before."""
    fake, stub, _ = served
    many = AdmitMany(stub.AdmitMany)
    await _ready(many)
    fake.silent = True
    stream = many.stream()
    assert stream is not None
    await stream.write(_request("a"))
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(stream.read(), 3 * BOUND)
    assert many.ready
    many.close()


async def _two_replicas(answer_seconds: float) -> tuple[list[_Scheduler], list[grpc.aio.Server], SchedulerReplicas]:
    fakes = [_Scheduler(), _Scheduler()]
    served = [await _scheduler(f) for f in fakes]
    addresses = [address for _, address in served]
    replicas = SchedulerReplicas(addresses, answer_seconds=answer_seconds)
    await _until(lambda: all(replicas.healthy(a) for a in addresses))

    def calls_open() -> bool:
        replicas.replenish()   # opens each healthy replica's AdmitMany call
        return all(replicas.client(a)._many.ready for a in addresses)

    await _until(calls_open)
    return fakes, [server for server, _ in served], replicas


async def test_a_quiet_replica_gets_no_new_request_before_it_can_be_called_silent() -> None:
    """0.1 s of owing an answer with nothing heard: new requests go to the
    next replica at once, instead of waiting the bound out with it; heard
    again, it is back at once, its call never failed."""
    fakes, servers, replicas = await _two_replicas(answer_seconds=30.0)
    addresses = replicas.addresses
    try:
        mine = next(f"r{i}" for i in range(100) if rendezvous_order(f"r{i}", addresses)[0] == addresses[1])
        fakes[1].silent = True
        session = await replicas.open(_request(mine).request)
        assert session.replica == addresses[1]
        await _until(lambda: not replicas.healthy(addresses[1]), 2.0)
        assert replicas.ranked(mine) == [addresses[0], addresses[1]]
        fakes[1].silent = False   # it answers what it owes
        await _until(lambda: replicas.healthy(addresses[1]))
        assert replicas.ranked(mine) == [addresses[1], addresses[0]]
        assert replicas.client(addresses[1])._many.ready
    finally:
        await replicas.close()
        for server in servers:
            await server.stop(0)


async def test_a_silent_replica_is_passed_over_until_it_answers_again() -> None:
    fakes, servers, replicas = await _two_replicas(answer_seconds=BOUND)
    addresses = replicas.addresses
    try:
        mine = next(f"r{i}" for i in range(100) if rendezvous_order(f"r{i}", addresses)[0] == addresses[1])
        fakes[1].silent = True
        session = await replicas.open(pb.AdmitRequest(request_id=mine, model=MODEL, tenant="t", prompt_tokens=4,
                                                      max_tokens=4))
        assert session.replica == addresses[1]
        await _until(lambda: not replicas.healthy(addresses[1]))
        assert replicas.client(addresses[1]).is_ready()   # its channel still says READY
        assert replicas.ranked(mine) == [addresses[0], addresses[1]]
        await asyncio.sleep(1.2)                         # past the broken-stream suspicion: still silent
        assert not replicas.healthy(addresses[1])
        fakes[1].silent = False
        await _until(lambda: replicas.healthy(addresses[1]))
        assert replicas.ranked(mine) == [addresses[1], addresses[0]]
    finally:
        await replicas.close()
        for server in servers:
            await server.stop(0)
