"""The runner's admission gate: at most `Window.size` lines in flight, none
started while the window is paused after a rejection (pacing.py). One per
batch service, shared by the batches it owns; event-loop only.

`release` and `close` are plain calls (no lock to await), so a line's task
that is cancelled -- even twice -- still gives its slot back in `finally`.
"""

from __future__ import annotations

import asyncio
import contextlib

from services.batch.pacing import Pace, Window
from services.common.clock import Clock

__all__ = ["Gate"]


class Gate:
    def __init__(self, window: Window, clock: Clock) -> None:
        self.window = window
        self._clock = clock
        self.in_flight = 0
        self.closed = False
        self._wake = asyncio.Event()   # set on each release / close: waiters look again

    def close(self) -> None:
        """Admit no more lines (the service drains); waiting ones get False."""
        self.closed = True
        self._wake.set()

    async def acquire(self) -> bool:
        """Wait for a slot: True once taken, False when the gate closed."""
        while True:
            if self.closed:
                return False
            pause = self.window.wait_seconds(self._clock.monotonic())
            if pause <= 0 and self.in_flight < self.window.size:
                self.in_flight += 1
                return True
            self._wake.clear()
            with contextlib.suppress(TimeoutError):  # woken by a release, or the pause's end
                await asyncio.wait_for(self._wake.wait(), pause if pause > 0 else None)

    async def emptied(self) -> None:
        """Until no line is in flight (a drain waits for it, bounded)."""
        while self.in_flight:
            self._wake.clear()
            await self._wake.wait()

    def observe(self, pace: Pace) -> None:
        self.window.observe(pace, self._clock.monotonic())

    def release(self) -> None:
        self.in_flight -= 1
        self._wake.set()
