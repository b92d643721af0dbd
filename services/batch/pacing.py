"""How many lines the batch service runs at once: an additive-increase /
multiplicative-decrease window, so a batch fills the fleet's idle capacity
without flooding the scheduler's queue.

Signals, per finished line (`Pace`, decided by execute.py `pace_of`):
- PLACED: the line was placed at once, or waited in the scheduler's queue
  no longer than it then ran (a backlog that keeps every freed slot busy)
  -> in slow start (below `threshold`, until the first QUEUED / REJECTED)
  the window grows by one line per such line, doubling each line's run
  time; after it, by one line per window's worth of such lines. Without the
  slow start a fresh runner's window crept from 4 by one line per line run
  time (~6 s in BENCHMARKS.md's batch bench): a 40 s P0 window saw ~9 lines
  of 16 slots in flight, 196 of ~285 idle tok/s, every first run alike;
- QUEUED: it waited in the queue longer than it ran (the fleet has no room
  for that many) -> the window shrinks by one;
- REJECTED: 429 / queue full / 503 (a rate limit, the queue, no engine)
  -> the window halves and new lines wait `backoff` seconds (doubling up
  to `max_backoff`, reset by the next PLACED); slow start ends.

Pure logic over an injected clock's time; the runner owns one `Window` and
calls it from its event loop only.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["Pace", "Window"]


class Pace(enum.Enum):
    PLACED = "placed"
    QUEUED = "queued"
    REJECTED = "rejected"
    NEUTRAL = "neutral"   # a line that ended otherwise (a client error): no signal


@dataclass
class Window:
    limit_max: int
    limit: float = 4.0
    min_backoff: float = 0.25
    max_backoff: float = 10.0
    backoff: float = 0.0        # the current pause after a rejection (0: none)
    paused_until: float = 0.0   # monotonic seconds; new lines wait until then
    # Slow start's end: below it each PLACED line adds a whole line (0 = set
    # to limit_max: until the fleet first says it is full, double).
    threshold: float = 0.0

    def __post_init__(self) -> None:
        self.limit = min(self.limit, float(self.limit_max))
        if self.threshold <= 0:
            self.threshold = float(self.limit_max)

    @property
    def size(self) -> int:
        """Lines that may run now (at least one)."""
        return max(1, int(self.limit))

    def observe(self, pace: Pace, now: float) -> None:
        if pace is Pace.PLACED:
            step = 1.0 if self.limit < self.threshold else 1.0 / self.size
            self.limit = min(float(self.limit_max), self.limit + step)
            self.backoff = 0.0
        elif pace is Pace.QUEUED:
            self.limit = max(1.0, self.limit - 1.0)
            self.threshold = self.limit
        elif pace is Pace.REJECTED:
            self.limit = max(1.0, self.limit / 2)
            self.threshold = self.limit
            self.backoff = min(self.max_backoff, max(self.min_backoff, self.backoff * 2))
            self.paused_until = max(self.paused_until, now + self.backoff)

    def wait_seconds(self, now: float) -> float:
        """How long new lines must still wait (0 = go)."""
        return max(0.0, self.paused_until - now)
