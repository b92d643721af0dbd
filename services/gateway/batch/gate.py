"""The runner's admission gate: at most `Window.size` lines in flight, none
started while the window is paused after a rejection (pacing.py). One per
gateway, shared by the batches it owns; event-loop only."""

from __future__ import annotations

import asyncio
import contextlib

from services.common.clock import Clock
from services.gateway.batch.pacing import Pace, Window

__all__ = ["Gate"]


class Gate:
    def __init__(self, window: Window, clock: Clock) -> None:
        self.window = window
        self._clock = clock
        self.in_flight = 0
        self.closed = False
        self._changed = asyncio.Condition()

    async def close(self) -> None:
        """Admit no more lines (the gateway drains); waiting ones get False."""
        async with self._changed:
            self.closed = True
            self._changed.notify_all()

    async def acquire(self) -> bool:
        """Wait for a slot: True once taken, False when the gate closed."""
        async with self._changed:
            while True:
                if self.closed:
                    return False
                pause = self.window.wait_seconds(self._clock.monotonic())
                if pause <= 0 and self.in_flight < self.window.size:
                    self.in_flight += 1
                    return True
                with contextlib.suppress(TimeoutError):  # woken by a release, or the pause's end
                    await asyncio.wait_for(self._changed.wait(), pause if pause > 0 else None)

    def observe(self, pace: Pace) -> None:
        self.window.observe(pace, self._clock.monotonic())

    async def release(self) -> None:
        async with self._changed:
            self.in_flight -= 1
            self._changed.notify_all()
