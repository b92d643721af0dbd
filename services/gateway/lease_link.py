"""One request's link to the scheduler: its lease, kept across scheduler restarts.

The lease is the request's Admit stream (`scheduler_client.AdmitSession`): it
is told `first_token` and `replace`, and ends with `done`. `LeaseLink` keeps
one for the request over its whole life:

- admitting (`admit`): a scheduler that is restarting
  (`errors.SchedulerRestarting`: unreachable, but it answered this gateway
  before) is waited for with backoff, up to `_READMIT_SECONDS`, before the
  error goes to the client; one never reached fails at once;
- waiting (`wait_placed`): `queued` positions go to the client until its
  first token (after it, the client's stream just stays open: heartbeats); a
  scheduler that restarts meanwhile gets the request again with its original
  arrival time and the prompt it has now (prompt + generated, like `replace`);
- running (`running_on`): the request keeps streaming from its engine if the
  scheduler restarts, while a child task re-attaches the lease
  (`AdmitRequest.running_on_engine`, retried with backoff until the engine
  has re-registered); `first_token` / `done` then go to the new stream;
- preempted: a `Preempted` from the scheduler (its slot went to a higher
  class) calls the `stop` given to `running_on` at once, from the Admit
  stream's reader task (`AdmitSession.listen`): the driver's engine read
  then raises and the driver calls `requeue` -- `Requeue` with prompt +
  generated, then waiting again as above. A `Preempted` once the request is
  no longer running on an engine (moving, requeued, done) is ignored;
- moving (`replace`): the request leaves a failed engine;
- ending (`report_done` + `close`, or `abandon`).

Several scheduler replicas (scheduler_replicas.py): the request's lease is
on one of them; when that one's stream breaks and another replica is healthy
(`SchedulerReplicas.fail_over`), the re-admission or re-attachment above goes
to it at once, without the restart backoff. A queued request answered
DRAINING by a replica shutting down (a rolling restart) is re-admitted the
same way (alone, the one scheduler's DRAINING is the client's 503, as always).

Ownership: the request's pump task alone calls a `LeaseLink`. The re-attach
child task is one other writer: it only swaps in the re-attached stream, and
the pump ends it before the lease moves or ends (`replace`, `requeue`,
`report_done`, `abandon`). The Admit stream's reader task is the other: it
only records a preemption and calls `stop` (`_on_preempted`), synchronously.
The tokens generated so far are the driver's list, read here (never written)
to describe the request as it stands now (`request_now.RequestNow`, which
builds the driver's next engine request from the same list).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass

from services.common.clock import Clock
from services.common.metric_labels import priority_label
from services.common.proto.kvmesh.v1 import scheduler_pb2
from services.gateway.errors import GatewayError, SchedulerRestarting
from services.gateway.events import Emit, Finished, QueuedUpdate
from services.gateway.jobs import Job
from services.gateway.metrics import GatewayMetrics
from services.gateway.request_now import RequestNow
from services.gateway.scheduler_client import AdmitSession
from services.gateway.scheduler_replicas import SchedulerReplicas
from services.gateway.stall_watch import GapSample

__all__ = ["LeaseLink"]

log = logging.getLogger(__name__)

# A scheduler restart while a request waits: admit again (same arrival time)
# for this long before answering 503. A restart takes 2-5 s on a busy 2-core
# machine (Python start-up, then engines re-register); leave room for more.
_READMIT_SECONDS = 30.0
# Backoff between re-admission / re-attach attempts while the scheduler (and
# the engines' registrations) come back: first wait, cap.
_BACKOFF_FIRST_SECONDS = 0.1
_BACKOFF_MAX_SECONDS = 1.0
# GatewayError.code of the scheduler's `Rejected` DRAINING (errors.from_rejection).
_DRAINING_CODE = scheduler_pb2.RejectCode.Name(scheduler_pb2.REJECT_CODE_DRAINING).lower()


@dataclass
class _Backoff:
    """Waits that double from the first to the cap."""

    delay: float = _BACKOFF_FIRST_SECONDS

    async def wait(self) -> None:
        await asyncio.sleep(self.delay)
        self.delay = min(self.delay * 2, _BACKOFF_MAX_SECONDS)


async def _open(
    scheduler: SchedulerReplicas, clock: Clock, request: scheduler_pb2.AdmitRequest
) -> AdmitSession:
    """Open an Admit stream, retrying with backoff for up to
    `_READMIT_SECONDS` while the scheduler restarts."""
    deadline = clock.monotonic() + _READMIT_SECONDS
    backoff = _Backoff()
    while True:
        try:
            return await scheduler.open(request)
        except SchedulerRestarting:
            if clock.monotonic() + backoff.delay >= deadline:
                raise
        log.debug("request %s: scheduler unreachable; admitting again in %.2fs", request.request_id, backoff.delay)
        await backoff.wait()


def _nothing() -> None:
    pass


class LeaseLink:
    """One request's lease on the scheduler (see the module docstring)."""

    def __init__(
        self,
        session: AdmitSession,
        job: Job,
        generated: list[int],
        scheduler: SchedulerReplicas,
        metrics: GatewayMetrics,
        clock: Clock,
    ) -> None:
        self._session = session
        self._job = job
        self._generated = generated
        # The request as it stands now (request_now.py): what a move asks for.
        self._now = RequestNow(job, generated)
        self._scheduler = scheduler
        self._metrics = metrics
        self._clock = clock
        # The engine generating now, and whether the current lease saw its
        # first token (told again on a re-attached stream); while not told
        # yet, when it came (monotonic): see `first_token_seen`.
        self._engine_id = ""
        self._told_first = False
        self._first_at: float | None = None
        # Generating on that engine (a preemption or a broken stream acts
        # only then), how to stop its stream, and when it was preempted.
        self._running = False
        self._stop_engine: Callable[[], None] = _nothing
        self._preempted_at: float | None = None
        # Between a `Placed` and the start on that engine, a `Preempted` is
        # about that new lease (the scheduler may take it back at once): it
        # is kept and acted on when the request starts there.
        self._placed_not_started = False
        self._early_preemption: scheduler_pb2.Preempted | None = None
        # Re-attaching the lease after a scheduler restart (a child of the pump).
        self._reattach: asyncio.Task[None] | None = None

    @classmethod
    async def admit(
        cls, job: Job, generated: list[int], scheduler: SchedulerReplicas, metrics: GatewayMetrics, clock: Clock
    ) -> LeaseLink:
        """Ask the scheduler for a lease (waiting out a restart)."""
        session = await _open(scheduler, clock, job.admit_request())
        return cls(session, job, generated, scheduler, metrics, clock)

    # ---------------------------------------------------------------- phases

    async def wait_placed(self, emit: Emit) -> scheduler_pb2.Placed:
        """Relay `queued` until `placed`. A scheduler that restarts while we
        wait gets the request again with the original arrival time."""
        readmit_until: float | None = None
        backoff = _Backoff()
        while True:
            try:
                outcome = await self._session.next_outcome()
            except GatewayError as exc:
                # A replica shutting down (a rolling restart) is a restart too
                # when there are others: one of them takes the request.
                draining = exc.code == _DRAINING_CODE and len(self._scheduler.addresses) > 1
                if not (isinstance(exc, SchedulerRestarting) or draining):
                    raise
                self._session.cancel()
                now = self._clock.monotonic()
                if readmit_until is None:
                    readmit_until = now + _READMIT_SECONDS
                if now >= readmit_until:
                    raise
                if not self._scheduler.fail_over(self._session):  # else another replica takes it now
                    await backoff.wait()
                self._session = await _open(self._scheduler, self._clock, self._now.admit_request())
                self._metrics.readmissions.labels("queued").inc()
                log.info("request %s: re-admitted after a scheduler restart", self._job.request_id)
                continue
            readmit_until, backoff = None, _Backoff()
            if isinstance(outcome, scheduler_pb2.Placed):
                self._placed_not_started = True
                return outcome
            if not self._generated:  # after the first token: heartbeats only
                await emit(QueuedUpdate(outcome.position, outcome.estimated_wait_seconds, outcome.priority))

    def running_on(self, engine_id: str, stop: Callable[[], None]) -> None:
        """The request starts generating on `engine_id`. From now on a
        `Preempted` calls `stop()` at once (it must stop the engine stream;
        the driver then calls `requeue`), and if the Admit stream breaks, the
        lease is re-attached in a child task."""
        self._engine_id = engine_id
        self._told_first = False
        self._first_at = None
        self._running = True
        self._stop_engine = stop
        self._placed_not_started = False
        self._session.listen(self._on_preempted)
        self._watch()
        early, self._early_preemption = self._early_preemption, None
        if early is not None:
            self._on_preempted(early)

    def _on_preempted(self, preempted: scheduler_pb2.Preempted) -> None:
        """The reader task got `Preempted`: stop the engine stream now, unless
        the request no longer runs (it finished, moves or waits already)."""
        if not self._running:
            if self._placed_not_started:
                self._early_preemption = preempted
                return
            log.debug("request %s: late Preempted ignored", self._job.request_id)
            return
        self._running = False
        self._preempted_at = self._clock.monotonic()
        log.info("request %s: preempted on engine %s by a P%d request (%d times)", self._job.request_id,
                 self._engine_id, preempted.by_priority, preempted.preemptions)
        self._job.trace.event("preempted", {"kvmesh.engine": self._engine_id, "kvmesh.by_priority":
                                            preempted.by_priority, "kvmesh.preemptions": preempted.preemptions})
        self._stop_engine()

    @property
    def told_first(self) -> bool:
        """The current lease saw its first token (checked per delta by the
        driver, so `first_token_seen` runs once per engine, not per token)."""
        return self._told_first

    @property
    def first_pending(self) -> bool:
        """The first token came and the scheduler was not told yet."""
        return self._first_at is not None

    def first_token_seen(self) -> None:
        """The current engine's first token reached the transport. Nothing
        is sent yet (the transport writes the token first): the driver calls
        `first_token_next` with the engine's next event, and a request that
        ends there folds `FirstToken` into its `done` -- one message to the
        scheduler instead of two for a short answer."""
        if not self._told_first:
            self._told_first = True
            self._first_at = self._clock.monotonic()

    async def first_token_next(self, final: bool) -> None:
        """The engine's next event after the first token: tell `FirstToken`
        now, dated back to when the token came -- unless that event ends the
        request (`final`): then `report_done` carries it. Either way the next
        request's Admit stream opens now, off its TTFT path."""
        self._scheduler.replenish()
        if not final:
            await self._tell_first()

    async def _tell_first(self) -> None:
        at, self._first_at = self._first_at, None
        if at is not None:
            await self._session.first_token(self._clock.monotonic() - at)

    def _first_ago(self) -> float | None:
        """How long ago the untold first token came (None: told, or none)."""
        at, self._first_at = self._first_at, None
        return None if at is None else self._clock.monotonic() - at

    async def replace(self, excluded: list[str], emit: Emit) -> scheduler_pb2.Placed:
        """Move the request off failed engines: a placement that excludes
        `excluded`, for prompt + generated and the max_tokens left."""
        if self._preempted_at is not None:
            # A `Preempted` crossed the engine's failure: the scheduler has
            # taken the lease back already and waits for `Requeue`.
            return await self.requeue(emit)
        # A re-attach in progress is superseded: the request moves anyway.
        self._running = False
        await self._stop_reattach()
        with contextlib.suppress(SchedulerRestarting):
            await self._tell_first()   # the lease it leaves had its first token
        now = self._now
        # A scheduler gone too: `wait_placed` reads the broken stream and
        # admits the request again with prompt + generated.
        with contextlib.suppress(SchedulerRestarting):
            await self._session.replace(
                exclude=list(excluded),
                prompt_tokens=len(now.tokens),
                max_tokens=now.max_tokens_left,
                prefix_hashes=now.prefix_hashes(),
            )
        return await self.wait_placed(emit)

    async def requeue(self, emit: Emit) -> scheduler_pb2.Placed:
        """After a preemption (the driver stopped the engine stream and kept
        its tokens): `Requeue` with prompt + generated and the max_tokens
        left, then wait for the next placement like a queued request."""
        self._running = False
        await self._stop_reattach()
        self._first_at = None   # that lease was taken back: its sample is moot
        preempted_at, self._preempted_at = self._preempted_at, None
        priority = priority_label(self._job.priority)
        self._metrics.preemptions.labels(priority).inc()
        now = self._now
        try:
            # A scheduler gone too: `wait_placed` reads the broken stream and
            # admits the request again (prompt + generated, same arrival).
            with contextlib.suppress(SchedulerRestarting):
                await self._session.requeue(
                    prompt_tokens=len(now.tokens),
                    max_tokens=now.max_tokens_left,
                    prefix_hashes=now.prefix_hashes(),
                )
            placed = await self.wait_placed(emit)
            self._job.trace.event("resumed", {"kvmesh.engine": placed.engine_id})
            return placed
        finally:
            since = self._clock.monotonic() if preempted_at is None else preempted_at
            self._metrics.preempted_seconds.labels(priority).observe(self._clock.monotonic() - since)

    async def report_done(self, finished: Finished, gaps: GapSample | None = None) -> None:
        """Send the outcome (cheap, no round trip), with the stream's sampled
        delta gaps for the scheduler's deadlines; `close()` afterwards."""
        # A re-attach still under way holds no lease yet: nothing to report.
        self._running = False
        await self._stop_reattach()
        first_ago = self._first_ago()   # not told yet: folded, one message for both
        await self._session.report_done(scheduler_pb2.RequestDone(
            prompt_tokens=finished.usage.prompt_tokens,
            completion_tokens=finished.usage.completion_tokens,
            cached_tokens=finished.usage.cached_tokens,
            finish_reason=finished.reason.value,
            delta_gaps_seconds=gaps.gaps if gaps is not None else (),
            max_delta_gap_seconds=gaps.max_gap if gaps is not None else 0.0,
            first_token=None if first_ago is None else scheduler_pb2.FirstToken(seconds_ago=first_ago),
        ))

    async def close(self) -> None:
        """After `report_done`: let the scheduler end the stream."""
        await self._session.close()

    async def abandon(self, resumable: bool = False) -> None:
        """The request failed or was cancelled: end the lease at once -- or,
        `resumable`, just drop the stream so the scheduler keeps the lease
        for a resume (a draining gateway leaving its streams)."""
        self._running = False
        if resumable:
            self._session.cancel()
        else:
            self._session.withdraw(self._first_ago())
        await self._stop_reattach()

    # ---------------------------------------------------------------- re-attach

    def _watch(self) -> None:
        session = self._session

        def broken() -> None:
            if not self._running or self._session is not session:
                return
            if self._reattach is None or self._reattach.done():
                self._reattach = asyncio.get_running_loop().create_task(
                    self._reattach_lease(), name=f"reattach-{self._job.request_id}")

        session.on_broken(broken)

    async def _reattach_lease(self) -> None:
        """Re-attach the running request on the restarted scheduler, retried
        with backoff until it is answered `placed` on that very engine. Ends
        when attached or when the pump cancels it (the request ended/moved)."""
        backoff = _Backoff()
        # Another scheduler replica is up: re-attach there at once.
        moving = self._scheduler.fail_over(self._session)
        while True:
            if not moving:
                await backoff.wait()
            moving = False
            session = await self._attach_once()
            if session is None:
                continue
            try:
                # Told to the old stream already: tell the new one. Still
                # pending: `first_token_next` tells it, on the new stream.
                if self._told_first and self._first_at is None:
                    await session.first_token()
            except BaseException:
                session.cancel()
                raise
            # No await from here on: the pump sees the old stream or the new
            # one, listened to and watched.
            old, self._session = self._session, session
            old.cancel()
            self._metrics.readmissions.labels("running").inc()
            log.info("request %s: lease re-attached on engine %s after a scheduler restart",
                     self._job.request_id, self._engine_id)
            session.listen(self._on_preempted)
            self._watch()
            return

    async def _attach_once(self) -> AdmitSession | None:
        """One attempt: an AdmitRequest with `running_on_engine`. The engine
        re-registers a moment after the scheduler is back; until then the
        answer is a queue place or a placement elsewhere, withdrawn at once."""
        try:
            session = await self._scheduler.open(self._now.admit_request(self._engine_id))
        except GatewayError:
            return None
        try:
            outcome = await session.next_outcome()
        except GatewayError:
            session.cancel()
            return None
        except BaseException:
            session.cancel()
            raise
        if not (isinstance(outcome, scheduler_pb2.Placed) and outcome.engine_id == self._engine_id):
            session.cancel()
            return None
        return session

    async def _stop_reattach(self) -> None:
        task, self._reattach = self._reattach, None
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
