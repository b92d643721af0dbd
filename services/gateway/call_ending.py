"""Ending a gRPC call politely, off the caller's path: write one last message
(the engine's `cancel`, the scheduler's `withdrawn`), then end the call.

The write runs in a background task so the caller (a handler being torn
down, a driver moving on) never waits on a slow peer; `CallEnder` holds
those tasks until they are done, as asyncio keeps only weak references to
tasks. One per client object (`EnginePool`, `SchedulerClient`), which hands
it to the calls it opens.
"""

from __future__ import annotations

import asyncio

import grpc

from services.gateway.many_call import ManyStream

__all__ = ["CallEnder"]

# The last message gets this long to go out; the call ends either way.
_LAST_WRITE_SECONDS = 0.5
# And the peer this long to end the call after reading it (`wait_end`).
_PEER_END_SECONDS = 2.0


class CallEnder:
    def __init__(self) -> None:
        self._ending: set[asyncio.Task[None]] = set()

    def end_after(self, call: grpc.aio.StreamStreamCall | ManyStream, last: object, wait_end: bool = False) -> None:
        """Write `last` on `call` (bounded), then cancel the call. `wait_end`:
        first let the peer end it (bounded) -- a call cancelled while `last`
        is still unread at the peer loses `last` there (the peer's read
        raises instead). Without it the call ends at once: an engine's reader
        waiting on it must wake now (a stall, a preemption)."""
        task = asyncio.get_running_loop().create_task(_write_then_end(call, last, wait_end))
        self._ending.add(task)
        task.add_done_callback(self._ending.discard)


async def _write_then_end(call: grpc.aio.StreamStreamCall | ManyStream, last: object, wait_end: bool) -> None:
    try:
        async with asyncio.timeout(_LAST_WRITE_SECONDS):
            await call.write(last)
        if wait_end:
            async with asyncio.timeout(_PEER_END_SECONDS):
                await call.code()
    except Exception:  # noqa: BLE001 - a call already broken or busy: end it anyway
        pass
    finally:
        call.cancel()
