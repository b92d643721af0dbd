"""The generation driver: one request from admission to its last token.

Phases (`_Generation.run`): admit -> wait until placed -> generate on the
placed engine, relaying its deltas -> on engine failure, migrate and generate
again; on preemption, requeue, wait and continue -> finish.

- Migration: the driver asks for a placement that excludes the failed engine
  and continues from prompt + tokens generated so far, with max_tokens
  reduced, up to `max_migrations` times: the client sees one seamless
  stream, from exactly the next token.
- Preemption: the scheduler gives the request's slot to a higher class and
  says `Preempted` on the Admit stream. The lease link stops the engine
  stream at once (its reader task calls `EngineStream.stop`, so the relay
  pays nothing per token: its pending engine read raises `EngineStopped`);
  the driver keeps every token so far and the text held back for stop
  strings (the same seam as a lost engine), answers `Requeue` and waits
  for the next placement -- the client's stream stays open, heartbeats
  only -- then continues there exactly like a migration. A preemption is
  not a failure: it uses no migration and excludes no engine.
  `max_generation_seconds` bounds the whole generation, waits included;
  the limit derived from live latency counts only time on engines.
- Deadlines from live latency: each `Placed` carries the first-token and
  stall deadlines the scheduler learned from the fleet's p95s
  (stall_watch.py): an engine silent past them is lost -- the stream
  migrates as above instead of waiting for keepalive or the engine's hang
  detector; and a generation limit, min'ed with `max_generation_seconds`.

Who owns what: each request's driver runs in ONE task (the pump of its
`event_stream.EventStream`), which alone owns the request's state: the
tokens generated so far (`_Generation`), its lease on the scheduler
(`lease_link.LeaseLink`: admission, re-admission and re-attachment after a
scheduler restart), its engine call (`engine_client.EngineStream`) and its
unsent text around stop strings across a migration (`stop_seam.StopSeam`).
`GenerationDriver` itself holds only what all requests share.

Resume (README "Resuming a stream"): every relayed engine delta is counted
across engines (`TextDelta.index`; each engine request carries the count so
far as `delta_offset`). A job with `resume_from` (a client that lost its
gateway re-sent the request) is re-admitted with `resume`, and the engine
call re-attaches to the kept generation (`EngineStream.resume`): its replay
rebuilds the tokens so far, and only deltas past `resume_from` reach the
client -- nothing repeated or missing.

Errors: failures before the first token raise `GatewayError` (the transport
can still answer with a status); after it, the stream ends with a `Finished`
event whose reason is ERROR / TIMEOUT / ABORT.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from services.common.clock import Clock
from services.common.proto.kvmesh.v1 import engine_pb2, scheduler_pb2
from services.gateway.choices import Choices
from services.gateway.engine_client import EnginePool, EngineStream
from services.gateway.errors import EngineFailure, EngineStopped, ErrorKind, GatewayError, finish_error
from services.gateway.event_stream import EventStream
from services.gateway.events import Emit, Finished, FinishReason, TextDelta, Usage
from services.gateway.jobs import Job
from services.gateway.lease_link import LeaseLink
from services.gateway.metrics import GatewayMetrics
from services.gateway.request_meter import RequestMeter
from services.gateway.request_now import RequestNow
from services.gateway.scheduler_replicas import SchedulerReplicas
from services.gateway.stall_watch import GenerationLimit, ProgressWatch, StallLimits, StallTimer
from services.gateway.stop_seam import StopSeam

__all__ = ["DriverSettings", "GenerationDriver", "Run"]

# One request's generation, given where to emit its events.
Run = Callable[[Emit], Awaitable[None]]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DriverSettings:
    max_migrations: int
    heartbeat_seconds: float
    # How long an engine that failed a request is not tried again for it: the
    # scheduler's own detection bound (keepalive + stale load reports; after
    # it the scheduler places nothing on a dead engine itself).
    exclude_failed_seconds: float = 12.0


class GenerationDriver:
    """Starts one `_Generation` per request; shared by all of them."""

    def __init__(
        self,
        scheduler: SchedulerReplicas,
        engines: EnginePool,
        settings: DriverSettings,
        metrics: GatewayMetrics,
        clock: Clock,
    ) -> None:
        self.scheduler = scheduler
        self.engines = engines
        self.settings = settings
        self.metrics = metrics
        self.clock = clock
        # Set by `detach_all`: streams ended from now on stay resumable.
        self.detaching = False
        # Requests tidying up after their last event (event_stream.py):
        # held here, as asyncio keeps only weak references to tasks.
        self._tidying: set[asyncio.Task[None]] = set()

    def detach_all(self) -> None:
        """From now on, a request whose client stream is closed by this
        gateway (a drain reaching its bound) leaves its generation and lease
        kept for a resume instead of cancelling them."""
        self.detaching = True

    def start(self, job: Job, tap: Callable[[Run], Run] | None = None) -> EventStream:
        """`tap` wraps the request's run (the response cache's recorder)."""
        run: Choices | _Generation
        if job.n > 1 or job.echo_text:
            run = Choices(job, functools.partial(_Generation, self))  # choices.py: n > 1, echo
        else:
            run = _Generation(self, job)
        metered = RequestMeter(self.metrics, job, self.clock).wrap(run.run)
        if tap is not None:
            metered = tap(metered)
        return EventStream(metered, self.settings.heartbeat_seconds, self.clock, run.before_close,
                           self.metrics.stream_signals, keep=self._keep_tidying)

    def _keep_tidying(self, task: asyncio.Task[None]) -> None:
        self._tidying.add(task)
        task.add_done_callback(self._tidying.discard)

    async def run(self, job: Job, emit: Emit) -> None:
        await _Generation(self, job).run(emit)


async def _no_emit(_event: object) -> None:
    raise RuntimeError("a generation emits only while it runs")


class _Generation:
    """One request's run, owned by its pump task."""

    def __init__(self, driver: GenerationDriver, job: Job) -> None:
        self._driver = driver
        self._job = job
        self._emit: Emit = _no_emit
        self._stream: EngineStream | None = None  # the engine call now
        self._generated: list[int] = []
        # The request as it stands now (request_now.py): what a next engine gets.
        self._now = RequestNow(job, self._generated)
        self._cached_tokens = 0
        self._seam = StopSeam(job.sampling.stop, job.sampling.min_tokens)
        # Engines that failed this request, with when (one entry per failure).
        self._failures: list[tuple[str, float]] = []
        self._first_token_at: float | None = None
        self._last_delta_at = 0.0
        # Engine deltas relayed so far (all engines), and the client's resume point.
        self._deltas = 0
        self._resume_from = job.resume_from
        self._resume_pending = job.resume_from is not None
        # The engine's progress (stall_watch.py).
        self._watch = ProgressWatch()
        self._reported_done = False   # `done` told the scheduler: nothing left to resume

    async def before_close(self) -> None:
        """The transport closes before the end (its client left): say
        `cancel` on the engine call first. Cancelling the pump while it
        waits in a grpc.aio read ends the call bare, which the engine would
        take for a vanished gateway and keep the generation for a resume."""
        if self._stream is not None and not self._detaching:
            await self._stream.say_cancel()

    @property
    def _detaching(self) -> bool:
        """Does a generation cut off here stay kept for a resume? Yes when
        this gateway is being cut (a drain's bound), and for a batch line,
        whose batch service resumes it when it comes back
        (services/gateway/batch_lines.py) -- until its end was reported:
        then the transport closing is just the line's end."""
        return self._driver.detaching or (self._job.batch and not self._reported_done)

    async def run(self, emit: Emit) -> None:
        self._emit = emit
        driver = self._driver
        lease = await LeaseLink.admit(self._job, self._generated, driver.scheduler, driver.metrics, driver.clock)
        try:
            placed = await lease.wait_placed(self._emit)
            finished = await self._generate(lease, placed)
        except BaseException:
            await lease.abandon(resumable=self._detaching)
            raise
        driver.metrics.child(driver.metrics.finished, finished.reason.value).inc()
        if self._job.trace.recording:
            self._job.trace.set_many({"gen_ai.response.finish_reasons": [finished.reason.value],
                                      "kvmesh.cached_tokens": finished.usage.cached_tokens})
        # `done` goes out before the client's last event, so a transport that
        # stops reading right after `Finished` cannot lose it.
        await lease.report_done(finished, self._watch.sample)
        self._reported_done = True
        try:
            await self._emit(finished)
        finally:
            if self._stream is not None:
                await self._stream.close()  # the engine may forget the generation now
        await lease.close()

    async def _generate(self, lease: LeaseLink, placed: scheduler_pb2.Placed) -> Finished:
        """Stream from the placed engine; on engine failure, migrate; when
        preempted, requeue and continue where it is placed next."""
        loop = asyncio.get_running_loop()
        limit = GenerationLimit.starting(
            self._job.max_generation_seconds, placed.generation_seconds, loop.time())
        while True:
            stream = self._stream = self._driver.engines.open(placed.engine_address, placed.engine_id)
            self._job.trace.set("kvmesh.engine", placed.engine_id)
            lease.running_on(placed.engine_id, stream.stop)
            move: Callable[[Emit], Awaitable[scheduler_pb2.Placed]]
            try:
                return await self._relay_until(limit.at, lease, placed, stream)
            except TimeoutError:
                await stream.abort()
                return self._timed_out(limit.seconds)
            except EngineStopped:
                stream.cancel()
                ended = await self._left_engine()
                move = lease.requeue
            except EngineFailure as failure:
                stream.cancel()
                ended = await self._engine_lost(failure)
                move = functools.partial(lease.replace, self._excluded())
                if ended is None:
                    self._driver.metrics.migrations.inc()
            except BaseException:
                if self._detaching:
                    stream.detach()
                else:
                    stream.cancel()
                raise
            if ended is not None:
                return ended
            left_at = loop.time()
            try:
                async with asyncio.timeout_at(limit.cap_at):
                    placed = await move(self._emit)
            except TimeoutError:
                return self._timed_out(limit.cap_seconds)
            limit.off_engine(loop.time() - left_at)

    async def _relay_until(
        self, deadline: float, lease: LeaseLink, placed: scheduler_pb2.Placed, stream: EngineStream,
    ) -> Finished:
        """`_relay` until `deadline` (loop time), then TimeoutError. A timer
        stops the engine call politely (`cancel` said), rather than a timeout
        cancelling the pending read -- that would end the call bare, and the
        engine would keep the generation for a resume (see `before_close`)."""
        expired = False

        def expire() -> None:
            nonlocal expired
            expired = True
            stream.stop()

        timer = asyncio.get_running_loop().call_at(deadline, expire)
        self._watch.start(StallLimits.from_placed(placed), self._driver.clock.monotonic())
        stall = StallTimer(self._watch, self._driver.clock, lambda _reason: stream.stop())
        stall.arm()
        try:
            return await self._relay(lease, placed, stream)
        except EngineStopped:
            if expired:
                raise TimeoutError from None
            if stall.reason is not None:  # the engine went silent: lost, like a broken stream
                self._driver.metrics.stalls.inc()
                raise EngineFailure(stream.engine_id, f"engine {stream.engine_id}: {stall.reason}") from None
            raise
        finally:
            timer.cancel()
            stall.cancel()
            self._watch.stop()

    async def _engine_lost(self, failure: EngineFailure) -> Finished | None:
        """The engine failed: how the request ends now, or None to migrate."""
        if self._now.max_tokens_left <= 0:
            return await self._left_engine()
        failures = len(self._failures) + 1
        log.warning("request %s: %s (failure %d)", self._job.request_id, failure.message, failures)
        self._job.trace.event("migration", {"kvmesh.engine": failure.engine_id, "kvmesh.failures": failures,
                                            "kvmesh.generated_tokens": len(self._generated),
                                            "kvmesh.reason": failure.message[:200]})
        if failures > self._driver.settings.max_migrations:
            return self._end(
                FinishReason.ERROR,
                f"engines failed {failures} times; retry later (last: {failure.message})",
                ErrorKind.UNAVAILABLE,
            )
        self._failures.append((failure.engine_id, self._driver.clock.monotonic()))
        return await self._left_engine()

    def _excluded(self) -> list[str]:
        """Engines not to place this request on: those that failed it
        lately. The scheduler itself stops placing on an engine within its
        detection bound (keepalive, stale reports); past that, an engine
        that failed and came back is as good as any (a stream that lost one
        engine to a partition and the other to a hang was refused
        `no_engine` with the first serving again)."""
        now = self._driver.clock.monotonic()
        return [e for e, at in self._failures if now - at < self._driver.settings.exclude_failed_seconds]

    async def _left_engine(self) -> Finished | None:
        """The request left its engine mid-stream (failed or preempted): how
        it ends now, or None to continue on the next engine."""
        if self._now.max_tokens_left <= 0:
            # Every token arrived; only the engine's `finished` was lost, and
            # with it the text it still held back.
            await self._send_tail(self._seam.flush())
            return self._end(FinishReason.LENGTH, "", ErrorKind.GENERATION_FAILED)
        if self._seam.on_engine_lost(len(self._generated)):
            # What the engine held back completes a stop string already.
            await self._send_tail(self._seam.flush())
            return self._end(FinishReason.STOP, "", ErrorKind.GENERATION_FAILED)
        return None

    def _timed_out(self, limit_seconds: float) -> Finished:
        return self._end(
            FinishReason.TIMEOUT, f"the generation ran past its {limit_seconds:g}s limit", ErrorKind.TIMEOUT,
        )

    async def _relay(self, lease: LeaseLink, placed: scheduler_pb2.Placed, stream: EngineStream) -> Finished:
        """Start the request on `stream` (resuming after what was generated)
        and relay its deltas to the client until it finishes."""
        if self._resume_pending:  # the first engine call of a resume re-attaches
            self._resume_pending = False
            await stream.resume(self._job.request_id, self._job.prompt_ids, self._job.trace_context)
        else:
            await stream.start(self._now.engine_request(placed.lease_id, self._deltas, placed.scheduler_replica))
        async for event in self._watched(stream):
            if lease.first_pending:
                # The first token's next event: FirstToken now, or in `done`
                # if this ends the request (lease_link.py).
                await lease.first_token_next(final=event.HasField("finished"))
                # The next request's engine stream opens now, off its TTFT path.
                self._driver.engines.replenish(placed.engine_address)
            if event.HasField("delta"):
                delta = event.delta
                self._deltas += 1
                if not delta.token_ids and not delta.text:
                    continue
                self._generated.extend(delta.token_ids)
                text, stopped = self._seam.on_delta(delta.text, delta.held_text)
                if self._resume_from is not None and self._deltas <= self._resume_from:
                    continue  # replayed: the client has it
                self._observe_delta(len(delta.token_ids))
                await self._emit(TextDelta(text, list(delta.token_ids), list(delta.logprobs), self._deltas))
                if stopped:
                    # A stop string across the seam: neither engine saw it whole.
                    await stream.abort()
                    return self._end(FinishReason.STOP, "", ErrorKind.GENERATION_FAILED)
                if not lease.told_first:
                    lease.first_token_seen()
                continue
            if event.HasField("resumed"):
                self._on_resumed(event.resumed)
                continue
            done = event.finished
            self._cached_tokens = min(done.usage.cached_tokens, len(self._job.prompt_ids))
            # Acknowledged (closed) once the client has the last event, in `run`.
            await self._send_tail(self._seam.on_finished())
            reason = FinishReason.from_proto(done.finish_reason)
            return self._end(reason, done.message, ErrorKind.GENERATION_FAILED)
        raise EngineFailure(stream.engine_id, f"engine {stream.engine_id}: stream ended early")  # pragma: no cover

    async def _watched(self, stream: EngineStream) -> AsyncIterator[engine_pb2.EngineGenerateEvent]:
        """The engine's events, each one progress for the stall watch, whose
        clock holds while the caller relays it (a slow client is no stall)."""
        watch, clock = self._watch, self._driver.clock
        async for event in stream.events():
            watch.delta(clock.monotonic())
            yield event
            watch.waiting(clock.monotonic())

    def _on_resumed(self, resumed: engine_pb2.EngineResumed) -> None:
        """The engine kept the generation: what came before its replay."""
        if self._resume_from is None or resumed.delta_offset > self._resume_from:
            # The client's last event came from an engine before a migration:
            # those deltas are gone (rare: a move just before the gateway died).
            raise GatewayError(ErrorKind.CONFLICT, "this stream cannot be resumed exactly after "
                               f"event {self._resume_from}; send the request again", code="resume_gap")
        self._generated.extend(resumed.prior_token_ids)
        self._deltas = resumed.delta_offset

    async def _send_tail(self, text: str) -> None:
        """Text released at the end, with no tokens of its own."""
        if text:
            await self._emit(TextDelta(text, []))

    def _observe_delta(self, n_tokens: int) -> None:
        metrics, now, labels = self._driver.metrics, self._driver.clock.monotonic(), self._job.metric_labels
        if self._first_token_at is None:
            self._first_token_at = now
            self._job.trace.event("first_token")
            metrics.child(metrics.ttft, *labels).observe(now - self._job.arrival_monotonic)
        elif n_tokens:
            metrics.child(metrics.inter_token, *labels).observe((now - self._last_delta_at) / n_tokens)
        self._last_delta_at = now

    def _end(self, reason: FinishReason, message: str, kind: ErrorKind) -> Finished:
        """The final event; a failure before any token raises `kind` instead,
        so the transport can still answer with a status code."""
        usage = Usage(len(self._job.prompt_ids), len(self._generated), self._cached_tokens)
        error = finish_error(reason, message, kind)
        if error is not None and not self._generated:
            raise error
        return Finished(reason, usage, message)
