"""The scheduler ends an Admit stream itself once it has read `done`
(`Placed.ends_at_done`): a gateway that knows it sends no half-close -- one
gRPC operation less per request -- and one that half-closes still works."""

from __future__ import annotations

import asyncio
import contextlib

import grpc

from services.common.proto.kvmesh.v1 import scheduler_pb2 as pb

from .test_grpc import TIMEOUT, admit_msg, hello, stack, wait_state

__all__ = ["stack"]   # the fixture (test_grpc.py), used by name


async def _placed(stub, rid: str) -> tuple[grpc.aio.StreamStreamCall, pb.Placed]:
    call = stub.Admit(timeout=TIMEOUT * 3)
    await call.write(admit_msg(rid))
    msg = await asyncio.wait_for(call.read(), TIMEOUT)
    while msg.WhichOneof("msg") == "queued":
        msg = await asyncio.wait_for(call.read(), TIMEOUT)
    assert msg.WhichOneof("msg") == "placed"
    return call, msg.placed


async def test_the_stream_ends_at_done_without_a_half_close(stack) -> None:
    _service, stub, _ = stack
    engine = stub.Connect(timeout=TIMEOUT * 3)
    await engine.write(hello())
    await engine.write(pb.EngineMessage(load=pb.LoadReport(serving=True, blocks_total=1000)))
    call, placed = await _placed(stub, "r1")
    assert placed.ends_at_done
    await call.write(pb.AdmitClientMessage(done=pb.RequestDone(
        completion_tokens=1, first_token=pb.FirstToken(seconds_ago=0.01))))
    assert await asyncio.wait_for(call.read(), TIMEOUT) is grpc.aio.EOF      # no done_writing sent
    assert await asyncio.wait_for(call.code(), TIMEOUT) == grpc.StatusCode.OK
    await wait_state(stub, lambda s: s.leases_total == 0)

    # A gateway from before: done, then the half-close it always sent.
    call, _ = await _placed(stub, "r2")
    await call.write(pb.AdmitClientMessage(first_token=pb.FirstToken()))
    await call.write(pb.AdmitClientMessage(done=pb.RequestDone(completion_tokens=4)))
    with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
        await call.done_writing()   # the scheduler may have ended the call already
    assert await asyncio.wait_for(call.read(), TIMEOUT) is grpc.aio.EOF
    await wait_state(stub, lambda s: s.leases_total == 0)
    engine.cancel()
