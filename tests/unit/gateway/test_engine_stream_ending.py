"""EngineStream: ending a call on purpose always lets its `cancel` reach the
engine first -- a call cut before it would leave the generation detached on
the engine (kept for a resume), refusing the request's next placement there."""

from __future__ import annotations

import asyncio

from services.common.proto.kvmesh.v1 import engine_pb2
from services.gateway.call_ending import CallEnder
from services.gateway.engine_client import EngineStream


class SlowCall:
    """A Generate call whose writes take a while to go out."""

    def __init__(self) -> None:
        self.events: list[str] = []
        self._done = False

    async def write(self, message: engine_pb2.EngineGenerateMessage) -> None:
        await asyncio.sleep(0.05)
        self.events.append(f"write:{message.WhichOneof('msg')}")

    def cancel(self) -> bool:
        self.events.append("cancel")
        self._done = True
        return True

    def done(self) -> bool:
        return self._done


async def test_cancel_after_stop_waits_for_the_cancel_message() -> None:
    call = SlowCall()
    stream = EngineStream(call, "engine-0", CallEnder())  # type: ignore[arg-type]  # fake call and ender: only what EngineStream uses
    stream.stop()  # a preemption: `cancel` goes out in the background
    stream.cancel()  # the driver then ends the call as it moves on
    assert call.events == []
    for _ in range(100):
        if call.done():
            break
        await asyncio.sleep(0.01)
    assert call.events == ["write:cancel", "cancel"]


async def test_cancel_after_said_cancel_ends_the_call_at_once() -> None:
    call = SlowCall()
    stream = EngineStream(call, "engine-0", CallEnder())  # type: ignore[arg-type]  # fake call and ender: only what EngineStream uses
    await stream.say_cancel()
    stream.cancel()
    assert call.events == ["write:cancel", "cancel"]
