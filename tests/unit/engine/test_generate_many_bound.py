"""A gateway that stops reading its GenerateMany call (wedged, SIGSTOPped)
sends no `hold`: the engine's frames for it are still bounded -- its
streams' writes wait once `QUEUED_FRAMES_HIGH` frames are queued behind the
call's stuck write, as on a full HTTP/2 window, and every frame goes out, in
order, once the gateway reads again."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest

from services.common.many_server import QUEUED_FRAMES_HIGH
from services.common.proto.kvmesh.v1 import engine_pb2
from services.engine.generate_many import GenerateManyCall

pytestmark = pytest.mark.unit

_STREAMS = 4
_EVENTS = QUEUED_FRAMES_HIGH     # per stream: four streams write twice the bound over


class _StuckContext:
    """A call whose client reads the "served" message, then nothing until `unstick`."""

    def __init__(self) -> None:
        self.incoming: asyncio.Queue[Any] = asyncio.Queue()
        self.written: list[engine_pb2.GenerateServerFrames] = []
        self._reading = asyncio.Event()

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return ()

    async def read(self) -> Any:
        return await self.incoming.get()

    async def write(self, message: engine_pb2.GenerateServerFrames) -> None:
        if self.written:   # the first ("served") goes out; then stuck
            await self._reading.wait()
        self.written.append(message)

    async def abort(self, code: grpc.StatusCode, details: str = "") -> None:
        raise AssertionError(f"aborted {code} {details}")

    def unstick(self) -> None:
        self._reading.set()


async def _handler(_request: object, context: Any) -> None:
    await context.read()
    for i in range(_EVENTS):
        await context.write(engine_pb2.EngineGenerateEvent(delta=engine_pb2.EngineDelta(token_ids=[i])))


async def test_a_gateway_that_stops_reading_holds_the_frames_at_the_bound() -> None:
    context = _StuckContext()
    call = GenerateManyCall(_handler, context)  # type: ignore[arg-type]  # the fake stands in for grpc's context
    server = asyncio.create_task(call.serve())
    start = engine_pb2.EngineGenerateMessage(request=engine_pb2.EngineRequest(request_id="r"))
    await context.incoming.put(engine_pb2.GenerateClientFrames(
        frames=[engine_pb2.GenerateClientFrame(stream=n, message=start) for n in range(1, _STREAMS + 1)]))
    async with asyncio.timeout(30):
        while call.queued < QUEUED_FRAMES_HIGH:
            await asyncio.sleep(0.01)
    held = call.queued
    for _ in range(20):   # the streams get every chance to write more: none may
        await asyncio.sleep(0.005)
    assert call.queued == held
    assert held < 2 * QUEUED_FRAMES_HIGH
    # The gateway reads again: everything, in order per stream, then each stream's end.
    context.unstick()
    ends: set[int] = set()
    got: dict[int, list[int]] = {n: [] for n in range(1, _STREAMS + 1)}
    async with asyncio.timeout(30):
        while len(ends) < _STREAMS:
            await asyncio.sleep(0.01)
            ends = {f.stream for m in context.written for f in m.frames if f.end}
    for message in context.written:
        for frame in message.frames:
            if frame.HasField("message"):
                got[frame.stream].extend(frame.message.delta.token_ids)
    assert all(ids == list(range(_EVENTS)) for ids in got.values())
    server.cancel()
