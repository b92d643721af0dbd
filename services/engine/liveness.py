"""Is the backend alive? The engine's watch for a dead or a hung backend.

Both are the engine's failure, never one request's (runtime.py `fail`):
- dead: the backend says so (`EngineBackend.dead_reason()`, polled here, so
  a core that dies while the engine is idle is noticed too), or a live
  stream raised EngineDead (the runtime's pump reports that at once);
- hung: the backend holds requests and has produced no output for longer
  than the hang bound, max(floor, k x p99 of its recent step intervals).

A step interval is the time between two consecutive outputs of ONE request:
one step's outputs reach all its requests together, so intervals taken
across requests would be mostly zeros, while a request's own outputs are a
step apart (more when it waited or was preempted, which only widens the
bound). The last STEP_WINDOW intervals count. Progress is any output of the
backend; the moment the backend goes from idle to holding requests counts
too, so idle time is never taken for a hang. A request's first output is no
interval (its prefill and queueing are not a step): the floor covers it.

An idle backend shows no progress, so while it holds no request the watch
probes it (`EngineBackend.probe`, every PROBE_EVERY_SECONDS, or a quarter
of the floor if that is shorter): a probe still
unanswered after the hang bound is a hang too. Without it a core wedged while
its streams were moved away -- the gateways' stall deadlines move them within
seconds, long before the hang bound -- would look idle and healthy forever,
and every request placed on it would stall in turn.

Past the bound, the backend's own processes are asked whether it is slow
rather than hung (slow_or_hung.py): still running or waiting to run, it is
given up to `busy_multiple` x the bound; stopped or blocked, it is hung.

`HangDetector` is pure -- fed times, it answers -- so the bound is tested on
a fake clock. `LivenessWatch` runs it: every check period (a quarter of the
floor, at most MAX_CHECK_SECONDS) it asks the backend and the detector, and
calls `on_failure(reason)` once. A hang is thus declared within bound +
period of the last progress.

Ownership: one EngineRuntime owns one LivenessWatch; every method runs on
the event loop thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from services.common.clock import Clock
from services.engine.backend import BackendActivity
from services.engine.slow_or_hung import SlowOrHung

__all__ = ["HangDetector", "HangPolicy", "LivenessWatch", "MAX_CHECK_SECONDS", "PROBE_EVERY_SECONDS", "STEP_WINDOW"]

log = logging.getLogger(__name__)

# Step intervals the bound is computed from: a few seconds of a busy engine,
# minutes of a quiet one -- recent enough to follow a load change.
STEP_WINDOW = 256
HANG_QUANTILE = 0.99
# A dead backend is acted on within this: vLLM's backend sees its processes
# die at once (vllm_backend/process_watch.py), and every further second a
# dead engine looks alive the scheduler may place work on it. A check is a
# few attribute reads, so four a second cost nothing.
MAX_CHECK_SECONDS = 0.25
# How often an idle backend is asked to prove it runs: cheap (one utility
# round trip to vLLM's core), and a wedged idle core is found within the
# hang bound + this.
PROBE_EVERY_SECONDS = 5.0
# A probe answered later than this is logged: a healthy idle core answers in
# milliseconds.
SLOW_PROBE_SECONDS = 1.0


@dataclass(frozen=True)
class HangPolicy:
    """engines.template.hang_floor_seconds / hang_step_multiple / hang_busy_multiple (their
    defaults, documented in services/common/config/engines.py)."""

    floor_seconds: float = 30.0
    step_multiple: float = 20.0
    busy_multiple: float = 4.0


class HangDetector:
    def __init__(self, policy: HangPolicy, now: float) -> None:
        self.policy = policy
        self._intervals: deque[float] = deque(maxlen=STEP_WINDOW)
        self._last_progress = now

    def output(self, now: float, interval: float | None) -> None:
        """The backend produced an output; `interval` is the time since the
        same request's previous output (None for its first)."""
        self._last_progress = now
        if interval is not None:
            self._intervals.append(interval)

    def idle(self, now: float) -> None:
        """The backend holds no request (or has just received its first):
        no progress is owed until now."""
        self._last_progress = now

    @property
    def last_progress(self) -> float:
        """When the backend last showed progress (or went idle)."""
        return self._last_progress

    def step_p99(self) -> float:
        if not self._intervals:
            return 0.0
        ordered = sorted(self._intervals)
        return ordered[max(0, math.ceil(HANG_QUANTILE * len(ordered)) - 1)]

    def bound(self) -> float:
        """Seconds without progress after which a busy backend is hung."""
        return max(self.policy.floor_seconds, self.policy.step_multiple * self.step_p99())

    def hung(self, now: float) -> str | None:
        """Why the backend is hung at `now` (it holds requests), or None."""
        silent, bound = now - self._last_progress, self.bound()
        if silent <= bound:
            return None
        return (f"backend hung: no output for {silent:.1f} s while holding requests (bound {bound:.1f} s "
                f"= max({self.policy.floor_seconds:g} s, {self.policy.step_multiple:g} x p99 step "
                f"{self.step_p99() * 1000:.0f} ms))")


class LivenessWatch:
    """The detector's task and the backend's own death report."""

    def __init__(
        self,
        policy: HangPolicy,
        clock: Clock,
        in_backend: Callable[[], int],
        dead_reason: Callable[[], str | None],
        on_failure: Callable[[str], None],
        probe: Callable[[], Awaitable[None]] | None = None,
        activity: Callable[[], BackendActivity | None] | None = None,
    ) -> None:
        self.detector = HangDetector(policy, clock.monotonic())
        self._slow = SlowOrHung(policy.busy_multiple)
        self._activity = activity or (lambda: None)
        self._probe = probe
        self._probe_task: asyncio.Future[None] | None = None
        self._probe_sent = -math.inf   # when the probe in flight (or the last one) was sent
        self._clock = clock
        self._in_backend = in_backend
        self._dead_reason = dead_reason
        self._on_failure = on_failure
        self._task: asyncio.Task[None] | None = None
        self.failure: str | None = None
        self.period = min(MAX_CHECK_SECONDS, policy.floor_seconds / 4)
        self.probe_every = min(PROBE_EVERY_SECONDS, policy.floor_seconds / 4)
        # Outputs and answered probes since the start (LoadReport.backend_progress).
        self.progress = 0

    def start(self) -> None:
        if self._task is None:
            self.detector.idle(self._clock.monotonic())
            self._task = asyncio.create_task(self._run(), name="liveness-watch")

    async def stop(self) -> None:
        probe, self._probe_task = self._probe_task, None
        if probe is not None and not probe.done():
            probe.cancel()
        task, self._task = self._task, None
        if task is not None and task is not asyncio.current_task():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def output(self, previous: float | None) -> float:
        """An output arrived now; `previous` is the time of the same
        request's previous output (None: its first). Returns now."""
        now = self._clock.monotonic()
        self.detector.output(now, None if previous is None else now - previous)
        self.progress += 1
        return now

    def entered(self) -> None:
        """A request entered an idle backend: progress is owed from now."""
        self.detector.idle(self._clock.monotonic())

    def check(self) -> str | None:
        """One look now; the failure (reported once) or None."""
        if self.failure is not None:
            return self.failure
        now = self._clock.monotonic()
        dead = self._dead_reason()
        if dead is not None:
            self.failure = f"backend dead: {dead}"
        elif self._in_backend() == 0:
            self.detector.idle(now)
            self.failure = self._probe_check(now)
        else:
            hang = self.detector.hung(now)
            self.failure = None if hang is None else self._slow.judge(
                hang, self.detector.last_progress, self.detector.bound(), now, self._activity())
        if self.failure is not None:
            self._on_failure(self.failure)
        return self.failure

    def _probe_check(self, now: float) -> str | None:
        """Send a probe when one is due; the hang if one went unanswered past the bound."""
        if self._probe is None:
            return None
        task = self._probe_task
        if task is not None and not task.done():
            waited, bound = now - self._probe_sent, self.detector.bound()
            if waited > bound:
                return self._slow.judge(f"backend hung: no answer to a liveness probe for {waited:.1f} s while idle "
                                        f"(bound {bound:.1f} s)", self._probe_sent, bound, now, self._activity())
            return None
        if task is not None and not task.cancelled() and task.exception() is not None:
            log.warning("liveness probe failed: %r", task.exception())
        if now - self._probe_sent >= self.probe_every:
            self._probe_sent = now
            self._probe_task = asyncio.ensure_future(self._timed_probe())
        return None

    async def _timed_probe(self) -> None:
        # A slow answer is the first sign of a core starved by its neighbours
        # (slow_or_hung.py): worth a line in the log before it nears the bound.
        if self._probe is None:
            return
        began = self._clock.monotonic()
        await self._probe()
        self.progress += 1
        took = self._clock.monotonic() - began
        if took > SLOW_PROBE_SECONDS:
            log.warning("liveness probe answered after %.1f s (hang bound %.1f s)", took, self.detector.bound())

    async def _run(self) -> None:
        # Polled: the bound runs on the injected clock, and no event says "nothing happened".
        while self.check() is None:  # noqa: ASYNC110 - see above
            await asyncio.sleep(self.period)
