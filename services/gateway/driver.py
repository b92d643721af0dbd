"""The generation driver: one request from admission to its last token.

Flow: Admit (relay queued positions) -> placed -> Engine.Generate on the
placed engine -> relay deltas (first_token on Admit) -> finished -> done on
Admit. If the engine breaks (before or after the first token) the driver sends
`replace` excluding it and continues from prompt + tokens generated so far,
with max_tokens reduced, up to `max_migrations` times: the client sees one
seamless stream.

Ownership: each request's driver runs in ONE task (`EventStream`'s pump), which
alone owns the request's Admit session, engine call and generated tokens.
Transports only read events from a bounded queue (backpressure: a slow client
stops the pump, which stops reading from the engine, which makes the engine
coalesce). Cancelling the stream (client gone) cancels that task, which
cancels the engine call and the Admit call at once, then re-raises.

Scheduler restarts (soft state): a request still waiting is re-admitted with
its original arrival time (and the prompt it has now: prompt + generated);
a request placed or generating keeps streaming from its engine while a child
task re-attaches its lease on the restarted scheduler (`AdmitRequest.
running_on_engine`, retried with backoff until the engine has re-registered),
after which first_token / done go to the new stream. A brand-new request that
meets a scheduler known to have answered before waits for it the same way.

Errors: failures before the first token raise `GatewayError` (the transport
can still answer with a status); after it, the stream ends with a `Finished`
event whose reason is ERROR / TIMEOUT / ABORT.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

from services.common.prefix_hash import block_hashes
from services.common.proto.kvmesh.v1 import common_pb2, engine_pb2, scheduler_pb2
from services.common.stop_text import StopText
from services.gateway.admission import AdmissionClient, AdmitSession
from services.gateway.engine_client import EnginePool, EngineStream
from services.gateway.errors import EngineFailure, ErrorKind, GatewayError
from services.gateway.jobs import Job
from services.gateway.metrics import GatewayMetrics

__all__ = [
    "DriverSettings",
    "EventStream",
    "FinishReason",
    "Finished",
    "GenerationDriver",
    "Heartbeat",
    "QueuedUpdate",
    "TextDelta",
    "Usage",
]

log = logging.getLogger(__name__)

# Events queued between the pump and the transport. Small on purpose: the
# engine coalesces when we fall behind, so a deep buffer only adds memory.
_QUEUE_DEPTH = 8
# A scheduler restart while a request waits: re-admit (same arrival time) for
# this long before answering 503. A restart takes 2-5 s on a busy 2-core
# machine (Python start-up, then engines re-register); leave room for more.
_READMIT_SECONDS = 30.0
# Backoff between re-admission / re-attach attempts while the scheduler (and
# the engines' registrations) come back: first wait, cap.
_BACKOFF_FIRST_SECONDS = 0.1
_BACKOFF_MAX_SECONDS = 1.0


class FinishReason(enum.Enum):
    """Closed set, mirrors kvmesh.v1.FinishReason; values are OpenAI's names."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    TIMEOUT = "timeout"
    ERROR = "error"

    @classmethod
    def from_proto(cls, value: int) -> FinishReason:
        return _FROM_PROTO.get(value, cls.ERROR)

    def to_proto(self) -> int:
        return _TO_PROTO[self]

    @property
    def ok(self) -> bool:
        return self in (FinishReason.STOP, FinishReason.LENGTH)


_FROM_PROTO = {
    common_pb2.FINISH_REASON_STOP: FinishReason.STOP,
    common_pb2.FINISH_REASON_LENGTH: FinishReason.LENGTH,
    common_pb2.FINISH_REASON_ABORT: FinishReason.ABORT,
    common_pb2.FINISH_REASON_TIMEOUT: FinishReason.TIMEOUT,
    common_pb2.FINISH_REASON_ERROR: FinishReason.ERROR,
}
_TO_PROTO = {v: k for k, v in _FROM_PROTO.items()}


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class QueuedUpdate:
    position: int
    estimated_wait_seconds: float
    priority: int


@dataclass(frozen=True)
class TextDelta:
    text: str
    token_ids: list[int]
    logprobs: list[common_pb2.TokenLogprob] = field(default_factory=list)


@dataclass(frozen=True)
class Finished:
    reason: FinishReason
    usage: Usage
    message: str = ""


@dataclass(frozen=True)
class Heartbeat:
    pass


Event = QueuedUpdate | TextDelta | Finished | Heartbeat
Emit = Callable[[QueuedUpdate | TextDelta | Finished], Awaitable[None]]


@dataclass(frozen=True)
class DriverSettings:
    max_migrations: int
    heartbeat_seconds: float


@dataclass
class _Progress:
    """One request's live state (owned by the pump task): its current Admit
    session (replaced on re-admission) and what it has produced so far."""

    session: AdmitSession
    generated: list[int] = field(default_factory=list)
    cached_tokens: int = 0
    last_delta_at: float = 0.0
    first_token_at: float | None = None
    # The engine generating now, and whether the current lease was told
    # `first_token` (re-sent on a re-attached stream).
    engine_id: str = ""
    told_first: bool = False
    # Re-attaching the lease after a scheduler restart (a child of the pump).
    reattach: asyncio.Task[None] | None = None
    # Stop strings across a migration: text of the tokens so far not sent to
    # the client yet (the engine's `held_text`, plus the seam's own hold);
    # after a migration, the seam that applies the stop strings to it and the
    # next engine's text, and what it released before that engine's first delta.
    held_text: str = ""
    seam: StopText | None = None
    seam_text: str = ""


class GenerationDriver:
    def __init__(
        self,
        admission: AdmissionClient,
        engines: EnginePool,
        settings: DriverSettings,
        metrics: GatewayMetrics,
    ) -> None:
        self._admission = admission
        self._engines = engines
        self._settings = settings
        self._metrics = metrics

    def start(self, job: Job) -> EventStream:
        return EventStream(lambda emit: self.run(job, emit), self._settings.heartbeat_seconds)

    # ---------------------------------------------------------------- phases

    async def run(self, job: Job, emit: Emit) -> None:
        progress = _Progress(await self._open_admit(job, job.admit_request()))
        try:
            placed = await self._wait_placed(job, progress, emit)
            finished = await self._generate(job, placed, progress, emit)
        except BaseException:
            progress.session.cancel()
            await self._stop_reattach(progress)
            raise
        # A re-attach still under way holds no lease yet: nothing to report.
        await self._stop_reattach(progress)
        self._metrics.finished.labels(finished.reason.value).inc()
        # `done` goes out before the client's last event, so a transport that
        # stops reading right after `Finished` cannot lose it.
        await progress.session.report_done(
            scheduler_pb2.RequestDone(
                prompt_tokens=finished.usage.prompt_tokens,
                completion_tokens=finished.usage.completion_tokens,
                cached_tokens=finished.usage.cached_tokens,
                finish_reason=finished.reason.value,
            )
        )
        await emit(finished)
        await progress.session.close()

    def _restarting(self, exc: GatewayError) -> bool:
        """The scheduler is unreachable but answered before: a restart to wait out."""
        return exc.code == "scheduler_unavailable" and self._admission.answered

    async def _open_admit(self, job: Job, request: scheduler_pb2.AdmitRequest) -> AdmitSession:
        """Open an Admit stream, retrying with backoff for up to
        `_READMIT_SECONDS` while the scheduler restarts."""
        deadline = time.monotonic() + _READMIT_SECONDS
        backoff = _BACKOFF_FIRST_SECONDS
        while True:
            try:
                return await self._admission.open(request)
            except GatewayError as exc:
                if not self._restarting(exc) or time.monotonic() + backoff >= deadline:
                    raise
            log.debug("request %s: scheduler unreachable; admitting again in %.2fs", job.request_id, backoff)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, _BACKOFF_MAX_SECONDS)

    def _admit_request(self, job: Job, progress: _Progress, running_on: str = "") -> scheduler_pb2.AdmitRequest:
        """The request as it stands now: after a migration the prompt is
        prompt + generated and max_tokens what is left (like `replace`)."""
        request = job.admit_request()
        if progress.generated:
            tokens = job.prompt_ids + progress.generated
            request.prompt_tokens = len(tokens)
            request.max_tokens = max(1, job.max_tokens - len(progress.generated))
            del request.prefix_hashes[:]
            request.prefix_hashes.extend(block_hashes(tokens, job.hash_block_tokens))
        request.running_on_engine = running_on
        return request

    async def _wait_placed(self, job: Job, progress: _Progress, emit: Emit) -> scheduler_pb2.Placed:
        """Relay `queued` until `placed`. A scheduler that restarts while we
        wait is re-admitted with the original arrival time."""
        readmit_until: float | None = None
        backoff = _BACKOFF_FIRST_SECONDS
        while True:
            try:
                outcome = await progress.session.next_outcome()
            except GatewayError as exc:
                if not self._restarting(exc):
                    raise
                progress.session.cancel()
                now = time.monotonic()
                readmit_until = readmit_until or now + _READMIT_SECONDS
                if now >= readmit_until:
                    raise
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, _BACKOFF_MAX_SECONDS)
                progress.session = await self._open_admit(job, self._admit_request(job, progress))
                self._metrics.readmissions.labels("queued").inc()
                log.info("request %s: re-admitted after a scheduler restart", job.request_id)
                continue
            readmit_until, backoff = None, _BACKOFF_FIRST_SECONDS
            if isinstance(outcome, scheduler_pb2.Placed):
                return outcome
            await emit(QueuedUpdate(outcome.position, outcome.estimated_wait_seconds, outcome.priority))

    async def _generate(self, job: Job, placed: scheduler_pb2.Placed, progress: _Progress, emit: Emit) -> Finished:
        """Stream from the placed engine; on engine failure, migrate."""
        excluded: list[str] = []
        failures = 0
        loop = asyncio.get_running_loop()
        deadline = loop.time() + job.max_generation_seconds
        while True:
            progress.engine_id = placed.engine_id
            self._watch_admit(job, progress)
            stream = self._engines.open(placed.engine_address, placed.engine_id)
            try:
                async with asyncio.timeout_at(deadline):
                    return await self._relay(job, placed, stream, progress, emit)
            except TimeoutError:
                await stream.abort()
                return self._end(
                    job, progress, FinishReason.TIMEOUT,
                    f"the generation ran past its {job.max_generation_seconds:g}s limit", ErrorKind.TIMEOUT,
                )
            except EngineFailure as failure:
                stream.cancel()
                if job.max_tokens - len(progress.generated) <= 0:
                    # Every token arrived; only the engine's `finished` was
                    # lost, and with it the text it still held back.
                    tail = progress.seam_text + progress.held_text
                    if tail:
                        await emit(TextDelta(tail, []))
                    return self._end(job, progress, FinishReason.LENGTH, "", ErrorKind.GENERATION_FAILED)
                failures += 1
                log.warning("request %s: %s (failure %d)", job.request_id, failure.message, failures)
                if failures > self._settings.max_migrations:
                    return self._end(
                        job, progress, FinishReason.ERROR,
                        f"engines failed {failures} times; retry later (last: {failure.message})",
                        ErrorKind.UNAVAILABLE,
                    )
                excluded.append(failure.engine_id)
                if self._open_seam(job, progress):
                    if progress.seam_text:
                        await emit(TextDelta(progress.seam_text, []))
                    return self._end(job, progress, FinishReason.STOP, "", ErrorKind.GENERATION_FAILED)
                placed = await self._replace(job, excluded, progress, emit)
                self._metrics.migrations.inc()
            except BaseException:
                stream.cancel()
                raise

    async def _replace(
        self, job: Job, excluded: list[str], progress: _Progress, emit: Emit
    ) -> scheduler_pb2.Placed:
        # A re-attach in progress is superseded: the request moves anyway.
        await self._stop_reattach(progress)
        tokens = job.prompt_ids + progress.generated
        try:
            await progress.session.replace(
                exclude=list(excluded),
                prompt_tokens=len(tokens),
                max_tokens=job.max_tokens - len(progress.generated),
                prefix_hashes=block_hashes(tokens, job.hash_block_tokens),
            )
        except GatewayError as exc:
            if not self._restarting(exc):
                raise
            # The scheduler is gone too: `_wait_placed` reads the broken
            # stream and re-admits with prompt + generated.
        return await self._wait_placed(job, progress, emit)

    # ---------------------------------------------------------------- re-attach

    def _watch_admit(self, job: Job, progress: _Progress) -> None:
        """When the current Admit stream breaks while the request runs on an
        engine, re-attach its lease in a child task (the stream goes on)."""
        session = progress.session

        def broken() -> None:
            if progress.session is session and (progress.reattach is None or progress.reattach.done()):
                progress.reattach = asyncio.get_running_loop().create_task(
                    self._reattach(job, progress), name=f"reattach-{job.request_id}")

        session.on_broken(broken)

    async def _reattach(self, job: Job, progress: _Progress) -> None:
        """Re-attach the running request on the restarted scheduler: an
        AdmitRequest with `running_on_engine`, retried with backoff until it
        is answered `placed` on that very engine (the engine re-registers a
        moment after the scheduler is back; until then the answer is a queue
        place or a placement elsewhere, which is withdrawn at once). Ends when
        attached or when the pump cancels it (the request finished/moved)."""
        backoff = _BACKOFF_FIRST_SECONDS
        while True:
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, _BACKOFF_MAX_SECONDS)
            try:
                session = await self._admission.open(self._admit_request(job, progress, progress.engine_id))
            except GatewayError:
                continue
            try:
                outcome = await session.next_outcome()
            except GatewayError:
                session.cancel()
                continue
            except BaseException:
                session.cancel()
                raise
            if not (isinstance(outcome, scheduler_pb2.Placed) and outcome.engine_id == progress.engine_id):
                session.cancel()
                continue
            old, progress.session = progress.session, session
            old.cancel()
            self._metrics.readmissions.labels("running").inc()
            log.info("request %s: lease re-attached on engine %s after a scheduler restart",
                     job.request_id, progress.engine_id)
            if progress.told_first:
                await session.first_token()
            self._watch_admit(job, progress)
            return

    @staticmethod
    async def _stop_reattach(progress: _Progress) -> None:
        task, progress.reattach = progress.reattach, None
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _relay(
        self,
        job: Job,
        placed: scheduler_pb2.Placed,
        stream: EngineStream,
        progress: _Progress,
        emit: Emit,
    ) -> Finished:
        generated = progress.generated
        sampling = job.sampling.to_proto(job.max_tokens - len(generated))
        if job.sampling.min_tokens:
            sampling.min_tokens = max(0, job.sampling.min_tokens - len(generated))
        await stream.start(
            engine_pb2.EngineRequest(
                request_id=job.request_id,
                prompt_token_ids=job.prompt_ids + generated,
                sampling=sampling,
                priority=job.priority,
                lease_id=placed.lease_id,
                resumed_tokens=len(generated),
            )
        )
        progress.told_first = False
        seam = progress.seam
        async for event in stream.events():
            if event.HasField("delta"):
                delta = event.delta
                if not delta.token_ids and not delta.text:
                    continue
                self._observe_delta(job, progress, len(delta.token_ids))
                generated.extend(delta.token_ids)
                text, stopped = delta.text, False
                if seam is not None:
                    text, stopped = seam.add(delta.text)
                    cut = -1 if stopped or not delta.held_text else seam.first_stop(delta.held_text)
                    if cut >= 0:
                        # The stop ends inside what this engine holds back for
                        # its own stop strings: it is there already, so stop
                        # now rather than one token later, as an unbroken run would.
                        text += (seam.held + delta.held_text)[:cut]
                        stopped = True
                text, progress.seam_text = progress.seam_text + text, ""
                progress.held_text = (seam.held if seam is not None else "") + delta.held_text
                await emit(TextDelta(text, list(delta.token_ids), list(delta.logprobs)))
                if stopped:
                    # A stop string across the seam: neither engine saw it whole.
                    await stream.abort()
                    return self._end(job, progress, FinishReason.STOP, "", ErrorKind.GENERATION_FAILED)
                if not progress.told_first:
                    progress.told_first = True
                    # Let the transport write the first token before we spend
                    # a gRPC write on the advisory `first_token` (TTFT path).
                    await asyncio.sleep(0)
                    await progress.session.first_token()
                    # The next request's streams open now, off its TTFT path.
                    self._admission.replenish()
                    self._engines.replenish(placed.engine_address)
                continue
            done = event.finished
            progress.cached_tokens = min(done.usage.cached_tokens, len(job.prompt_ids))
            await stream.close()
            tail = progress.seam_text + (seam.flush() if seam is not None else "")
            progress.seam_text = ""
            if tail:
                await emit(TextDelta(tail, []))
            reason = FinishReason.from_proto(done.finish_reason)
            return self._end(job, progress, reason, done.message, ErrorKind.GENERATION_FAILED)
        raise EngineFailure(stream.engine_id, f"engine {stream.engine_id}: stream ended early")  # pragma: no cover

    # ---------------------------------------------------------------- helpers

    @staticmethod
    def _open_seam(job: Job, progress: _Progress) -> bool:
        """Before resuming on another engine: carry the text the dead engine
        held back (a possible stop-string start, never sent) across the seam,
        where the stop strings now apply to it followed by the next engine's
        text. True if that text already completes a stop string (then
        `seam_text` is what precedes it, and the request is finished)."""
        # Also what an earlier seam released or held for an engine that then
        # failed before its first delta.
        carried = progress.seam_text + progress.held_text
        if not job.sampling.stop or len(progress.generated) < job.sampling.min_tokens:
            # No stop can apply here: the held text just goes out first.
            progress.seam, progress.seam_text, progress.held_text = None, carried, ""
            return False
        seam = StopText(job.sampling.stop)
        released, stopped = seam.add(carried)
        progress.seam, progress.seam_text, progress.held_text = seam, released, seam.held
        return stopped

    def _observe_delta(self, job: Job, progress: _Progress, n_tokens: int) -> None:
        now = time.monotonic()
        if progress.first_token_at is None:
            progress.first_token_at = now
            self._metrics.ttft.labels(job.route).observe(now - job.arrival_monotonic)
        elif n_tokens:
            self._metrics.inter_token.observe((now - progress.last_delta_at) / n_tokens)
        progress.last_delta_at = now

    @staticmethod
    def _end(job: Job, progress: _Progress, reason: FinishReason, message: str, kind: ErrorKind) -> Finished:
        """The final event; a failure before any token raises `kind` instead,
        so the transport can still answer with a status code."""
        usage = Usage(len(job.prompt_ids), len(progress.generated), progress.cached_tokens)
        if not reason.ok and not progress.generated:
            if reason is FinishReason.TIMEOUT:
                kind = ErrorKind.TIMEOUT
            raise GatewayError(kind, message or f"the generation ended with {reason.value}", code=reason.value)
        return Finished(reason, usage, message)


class EventStream:
    """Runs a driver in its own task behind a bounded queue, and adds
    heartbeats: if nothing was sent for `heartbeat_seconds`, iteration yields
    `Heartbeat()`. Iteration ends after `Finished`. Always `aclose()` it
    (cancels the driver if still running)."""

    _END = object()

    def __init__(self, run: Callable[[Emit], Awaitable[None]], heartbeat_seconds: float) -> None:
        self._queue: asyncio.Queue[object] = asyncio.Queue(_QUEUE_DEPTH)
        self._heartbeat = heartbeat_seconds
        self._last_output = time.monotonic()
        # An event taken from the queue while merging deltas, yielded next.
        self._held: object | None = None
        self._task = asyncio.create_task(self._pump(run))

    async def _pump(self, run: Callable[[Emit], Awaitable[None]]) -> None:
        try:
            await run(self._queue.put)
        except GatewayError as exc:
            await self._queue.put(exc)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - any bug must end the stream, not hang it
            log.exception("generation driver failed")
            await self._queue.put(GatewayError(ErrorKind.INTERNAL, f"internal error: {type(exc).__name__}"))
        await self._queue.put(self._END)

    def mark_output(self) -> None:
        """The transport wrote something: restart the heartbeat timer."""
        self._last_output = time.monotonic()

    def __aiter__(self) -> AsyncIterator[Event]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Event]:
        while True:
            try:
                if self._held is not None:
                    item, self._held = self._held, None
                else:
                    item = self._queue.get_nowait()
            except asyncio.QueueEmpty:
                wait = self._last_output + self._heartbeat - time.monotonic()
                try:
                    async with asyncio.timeout(max(wait, 0.0)):
                        item = await self._queue.get()
                except TimeoutError:
                    self.mark_output()
                    yield Heartbeat()
                    continue
            if item is self._END:
                return
            if isinstance(item, GatewayError):
                raise item
            if isinstance(item, TextDelta) and not self._queue.empty():
                item = self._merge_queued(item)
            yield item  # type: ignore[misc]
            if isinstance(item, Finished):
                return  # the last event; the pump only tidies up after it

    def _merge_queued(self, first: TextDelta) -> TextDelta:
        """Backpressure by coalescing, gateway side: deltas that queued up
        while the transport was writing go out as ONE event (one JSON encode,
        one SSE write), in order, nothing dropped. The first other event is
        held back and yielded next."""
        texts, ids, logprobs = [first.text], list(first.token_ids), list(first.logprobs)
        while True:
            try:
                item = self._queue.get_nowait()
            except asyncio.QueueEmpty:
                break
            if not isinstance(item, TextDelta):
                self._held = item
                break
            texts.append(item.text)
            ids.extend(item.token_ids)
            logprobs.extend(item.logprobs)
        return TextDelta("".join(texts), ids, logprobs)

    async def aclose(self) -> None:
        if not self._task.done():
            self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
