"""Injectable clocks, so aging, TTL and fairness run on a fake clock in tests."""

from __future__ import annotations

import time
from typing import Protocol

__all__ = ["Clock", "FakeClock", "SystemClock"]


class Clock(Protocol):
    def monotonic(self) -> float:
        """Seconds from an arbitrary origin; never goes backwards."""

    def wall(self) -> float:
        """Unix time in seconds (crosses process boundaries, e.g. arrival)."""


class SystemClock:
    def monotonic(self) -> float:
        return time.monotonic()

    def wall(self) -> float:
        return time.time()


class FakeClock:
    """A clock that moves only when told to."""

    def __init__(self, start: float = 1000.0, wall_offset: float = 1.7e9) -> None:
        self._now = start
        self._wall_offset = wall_offset

    def monotonic(self) -> float:
        return self._now

    def wall(self) -> float:
        return self._now + self._wall_offset

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError("a clock never goes backwards")
        self._now += seconds
