"""The driver's watch over one stream's progress on its engine.

The scheduler's deadline book (services/scheduler/deadlines.py) sends, in
each `Placed`, how long a healthy engine takes at most to the first token
(`first_token_seconds`) and between two deltas (`token_stall_seconds`), both
3x the fleet's live p95 within a floor and a ceiling. An engine that stays
silent longer -- alive on the network (so keepalive does not fire) but
producing nothing -- has lost the request: the driver stops the stream and
migrates it like any engine failure (`EngineFailure`: excluded, counted
against `gateway.max_migrations`, its lease replaced and so fenced).

What counts is only the time the driver waits for its engine: the clock
runs from the start on an engine (first token) or from the moment the
driver is back reading after relaying a delta, and stops while the driver
hands a delta to a slow client (backpressure is not a stall) and while the
request is off any engine (requeued after a preemption, moving): each
engine start arms the watch again, and `stop` disarms it.

A request that stalled once gets twice the limits on its next engine (and
so on): if the whole fleet slowed down faster than the p95 followed, the
request then waits longer rather than being moved off every engine in turn
until it runs out of migrations or engines.

`GenerationLimit` is the whole generation's time limit: the job's cap, and
the one derived from live latency, which stops while the request waits off
any engine (requeued after a preemption, moving after a failure).

`ProgressWatch` is pure (fed times, it answers), tested on a fake clock;
`StallTimer` runs it on the event loop with one timer re-armed lazily (a
delta costs two attribute writes, not a timer). The gaps it sees between
deltas are kept as a small reservoir sample (`GapSample`) that the lease
reports in `RequestDone`, so the scheduler learns the p95 the next
deadlines come from.

Ownership: one request's pump task owns its watch, sample and timer; the
timer's callback runs on the same loop and only calls `on_stall`.
"""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field

from services.common.clock import Clock
from services.common.proto.kvmesh.v1 import scheduler_pb2

__all__ = ["GAP_SAMPLES", "GapSample", "GenerationLimit", "ProgressWatch", "StallLimits", "StallTimer"]

# Delta gaps a request reports (RequestDone.delta_gaps_seconds): enough for
# the scheduler's window to fill from a few dozen requests, little per request.
GAP_SAMPLES = 16


@dataclass(frozen=True)
class StallLimits:
    first_token_seconds: float
    token_stall_seconds: float
    token_stall_p95_seconds: float = 0.0

    @classmethod
    def from_placed(cls, placed: scheduler_pb2.Placed) -> StallLimits | None:
        """None when the scheduler sent none (deadlines off, or an older one)."""
        if placed.first_token_seconds <= 0 or placed.token_stall_seconds <= 0:
            return None
        return cls(placed.first_token_seconds, placed.token_stall_seconds, placed.token_stall_p95_seconds)


@dataclass
class GenerationLimit:
    """When the whole generation times out (loop time). Two limits, the
    earlier wins: the job's cap (`gateway.max_generation_seconds`, a key's
    or the request's) counts every wait; the one derived from the fleet's
    live latency (`Placed.generation_seconds`: 3x what a healthy engine
    takes for this many tokens) counts only time on engines, not a wait to
    be placed again. After a preemption that wait is the scheduler's choice,
    bounded by aging: a batch request that yielded its slot must not time
    out for it (at 4x overload P2 requests requeued behind P0 and P1 work
    did). After an engine failure it may be a restart of the model's last
    engine (scheduler.engine_return_seconds): the stream that waited for it
    must not time out either."""

    cap_seconds: float
    derived_seconds: float  # 0: none (deadlines off)
    cap_at: float
    derived_at: float

    @classmethod
    def starting(cls, cap_seconds: float, derived_seconds: float, now: float) -> GenerationLimit:
        derived_at = now + derived_seconds if derived_seconds > 0 else math.inf
        return cls(cap_seconds, derived_seconds, now + cap_seconds, derived_at)

    @property
    def at(self) -> float:
        return min(self.cap_at, self.derived_at)

    @property
    def seconds(self) -> float:
        """The limit that ends the generation at `at`, for its message."""
        return self.cap_seconds if self.cap_at <= self.derived_at else self.derived_seconds

    def off_engine(self, seconds: float) -> None:
        """The request waited `seconds` off any engine to be placed again."""
        self.derived_at += max(seconds, 0.0)


@dataclass
class GapSample:
    """A reservoir sample (Algorithm R) of the gaps between deltas, and the max."""

    gaps: list[float] = field(default_factory=list)
    seen: int = 0
    max_gap: float = 0.0

    def add(self, gap: float) -> None:
        self.seen += 1
        if gap > self.max_gap:
            self.max_gap = gap
        if len(self.gaps) < GAP_SAMPLES:
            self.gaps.append(gap)
            return
        slot = int(random.random() * self.seen)
        if slot < GAP_SAMPLES:
            self.gaps[slot] = gap


class ProgressWatch:
    """Is the engine overdue? Armed by `start` on each engine, disarmed by
    `stop`; `hold` pauses it while the driver is busy with the client."""

    def __init__(self, sample: GapSample | None = None) -> None:
        self.sample = sample if sample is not None else GapSample()
        self._limits: StallLimits | None = None
        self._since = 0.0          # when the driver began waiting for the engine
        self._first = True         # no delta yet on this engine
        self._held = False
        self._backoff = 1.0        # doubled by each stall of this request

    @property
    def armed(self) -> bool:
        return self._limits is not None

    def start(self, limits: StallLimits | None, now: float) -> None:
        """A new engine stream: wait for its first delta."""
        self._limits, self._since, self._first, self._held = limits, now, True, False

    def delta(self, now: float) -> None:
        """A delta arrived: its gap is sampled; the clock holds while relaying."""
        if not self._first:
            self.sample.add(now - self._since)
        self._first, self._held = False, True

    def waiting(self, now: float) -> None:
        """The driver is back reading from the engine."""
        self._since, self._held = now, False

    def stop(self) -> None:
        """Off the engine (finished, failed, preempted, moving): no clock."""
        self._limits = None

    def stalled(self) -> None:
        """This request's engine was declared lost for silence: the next
        engine gets twice the limits."""
        self._backoff *= 2

    def limit(self) -> float:
        if self._limits is None:
            return 0.0
        limits = self._limits
        return (limits.first_token_seconds if self._first else limits.token_stall_seconds) * self._backoff

    def check_within(self) -> float:
        """Look again at least this often: the first token's limit may be
        long, and once it came, the (shorter) stall limit runs from it."""
        return 0.0 if self._limits is None else self._limits.token_stall_seconds * self._backoff

    def due_at(self) -> float | None:
        """When the engine becomes overdue if nothing happens (None: unarmed)."""
        if self._limits is None:
            return None
        return self._since + self.limit()

    def overdue(self, now: float) -> str | None:
        """Why the engine is lost now, or None."""
        due = self.due_at()
        if due is None or self._held or now < due or self._limits is None:
            return None
        if self._first:
            return (f"no first token within {self.limit():.3g}s of starting on the engine "
                    "(first-token deadline from the fleet's live p95)")
        p95 = self._limits.token_stall_p95_seconds
        source = f"from the live p95 gap {p95:.3g}s" if p95 > 0 else "the default, too few samples"
        return f"no token for {now - self._since:.3g}s, past the stall deadline {self.limit():.3g}s ({source})"


class StallTimer:
    """Runs a `ProgressWatch` on the loop: one timer at the watch's due time,
    re-armed when it finds progress since; calls `on_stall(reason)` once."""

    def __init__(self, watch: ProgressWatch, clock: Clock, on_stall: Callable[[str], None]) -> None:
        self._watch = watch
        self._clock = clock
        self._on_stall = on_stall
        self._handle: asyncio.TimerHandle | None = None
        self.reason: str | None = None

    def arm(self) -> None:
        """Look at the watch when it is next due (at least every stall
        limit); `_fire` re-arms itself until the watch trips or stops."""
        due = self._watch.due_at()
        if due is None or self.reason is not None:
            return
        now = self._clock.monotonic()
        # Not due yet (progress moved it), or held (relaying to a slow
        # client): look again when due, or a stall limit from now.
        delay = due - now if due > now else self._watch.limit()
        delay = min(delay, self._watch.check_within())
        self._handle = asyncio.get_running_loop().call_later(max(delay, 0.001), self._fire)

    def _fire(self) -> None:
        self._handle = None
        reason = self._watch.overdue(self._clock.monotonic())
        if reason is None:
            self.arm()
            return
        self.reason = reason
        self._watch.stalled()
        self._on_stall(reason)

    def cancel(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
