"""Many bidi streams over one long-lived gRPC call: the gateway's side of
`Scheduler.AdmitMany` (admit_many.py) and `Engine.GenerateMany`
(generate_many.py).

A grpc.aio call per request costs the gateway a call set-up and, per
message, a grpc.aio write or read -- most of a short request's CPU here
(BENCHMARKS.md "Short requests"). On one of these calls each request's
stream is a `ManyStream`: its writes become frames that the writer task
sends, all those of a loop turn in one gRPC message, and the reader task
hands each stream its frames. `ManyStream` has the part of a grpc.aio call
the gateway's users of a call use (write, read, cancel, done, code,
add_done_callback), with the same meanings: read returns EOF once the peer
ended the stream OK, raises an AioRpcError when it ended it with a status or
the call failed, and CancelledError once cancelled here; so the logic above
it is the same on both.

The call is opened in the background; until the peer has answered it (its
empty first message) requests use per-request calls, and so they do with a
peer from before the call existed (UNIMPLEMENTED, tried again after
`_RETRY_OLD_SECONDS`) and after the call failed (a restart: tried again after
`_RETRY_SECONDS`; its streams fail like broken calls).

A peer that answers each stream's first message at once (the scheduler:
Queued, Placed or Rejected) can be watched for silence (`answer_seconds`):
when a stream's first message has waited that long for its answer and
nothing at all came on the call since it was sent, the call is presumed
gone -- a host cut off without a reset, a process stopped or wedged -- and
fails like a broken one (its streams move: lease_link.py), and `on_silent`
is told. Keepalive would notice a cut host too, but only after
`network.detect_seconds` (10 s), and never a process whose event loop is
stuck while gRPC's own threads still answer pings. A busy peer is not
silent: answers to earlier streams, however late, keep the call heard.

Ownership: the client object (SchedulerClient, EnginePool) owns its
`ManyCall`; everything runs on the event loop.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc

__all__ = ["OK", "FrameKind", "ManyCall", "ManyStream"]

log = logging.getLogger(__name__)

# After the call failed, per-request calls until trying it again.
_RETRY_SECONDS = 1.0
# A peer without the call (UNIMPLEMENTED), or one whose mesh TLS policy does
# not let this gateway call it (PERMISSION_DENIED: a peer from before the
# call was listed): try again this much later (it may be upgraded in place).
_RETRY_OLD_SECONDS = 30.0
_NOT_SERVED = frozenset({grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.PERMISSION_DENIED})

# A silence watch that fires this late means this gateway's own loop was
# stalled (a loaded machine): it looks again after the reads that waited
# (half the bound later), and judges only on a watch that fired on time.
_STALLED_LOOP_SECONDS = 0.1
_REREAD_SECONDS = 0.02

OK = "ok"
_CANCELLED = "cancelled"


@dataclass(frozen=True)
class FrameKind:
    """One protocol's frame messages (AdmitMany's, GenerateMany's)."""

    name: str
    client_frame: Callable[..., Any]      # (stream=, message=, end=) -> client frame
    client_frames: Callable[..., Any]     # (frames=) -> one gRPC message
    # A server frame's end of its stream: None (not ended), OK, or the
    # status it ended with (an AioRpcError).
    ending: Callable[[Any], str | grpc.aio.AioRpcError | None]
    # Flow control (0 = none): this many unread messages of a stream send a
    # `hold` frame, and reading it down to a quarter of that a `release`.
    hold_at: int = 0


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


def _copy(err: grpc.aio.AioRpcError) -> grpc.aio.AioRpcError:
    """The stream's failure, as each read or write raises it."""
    return grpc.aio.AioRpcError(err.code(), err.initial_metadata(), err.trailing_metadata(),
                                err.details(), err.debug_error_string())


class ManyStream:
    """One stream on the call (see the module docstring)."""

    __slots__ = ("_many", "number", "_inbox", "_waiter", "_ended", "_callbacks", "_held", "_wrote")

    def __init__(self, many: ManyCall, number: int) -> None:
        self._many = many
        self.number = number
        self._inbox: collections.deque[Any] = collections.deque()
        self._waiter: asyncio.Future[None] | None = None
        # None while open; then OK, _CANCELLED or the AioRpcError it ended with.
        self._ended: str | grpc.aio.AioRpcError | None = None
        self._callbacks: list[Callable[[Any], None]] = []
        self._held = False   # a `hold` frame was sent, no `release` yet
        self._wrote = False  # its first message is sent (and owed an answer)

    def done(self) -> bool:
        return self._ended is not None

    def add_done_callback(self, callback: Callable[[Any], None]) -> None:
        if self._ended is not None:
            callback(self)
        else:
            self._callbacks.append(callback)

    async def write(self, message: object) -> None:
        ended = self._ended
        if isinstance(ended, grpc.aio.AioRpcError):
            raise _copy(ended)
        if ended is not None:
            raise asyncio.InvalidStateError(f"the {self._many.kind.name} stream is already over")
        self._many.send(self._many.kind.client_frame(stream=self.number, message=message))
        if not self._wrote:
            self._wrote = True
            self._many.owe(self.number)

    async def done_writing(self) -> None:
        """Nothing to send: the peers end these streams themselves."""

    async def read(self) -> object:
        while not self._inbox:
            ended = self._ended
            if ended == OK:
                return grpc.aio.EOF
            if ended == _CANCELLED:
                raise asyncio.CancelledError()
            if isinstance(ended, grpc.aio.AioRpcError):
                raise _copy(ended)
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        if self._ended == _CANCELLED:
            raise asyncio.CancelledError()
        if self._held and len(self._inbox) <= self._many.kind.hold_at // 4:
            self._held = False
            self._many.send(self._many.kind.client_frame(stream=self.number, release=True))
        return self._inbox.popleft()

    async def code(self) -> grpc.StatusCode:
        """The stream's status, once it ended (as a call's `code()`)."""
        if self._ended is None:
            ended: asyncio.Future[None] = asyncio.get_running_loop().create_future()

            def wake(_stream: object) -> None:
                if not ended.done():
                    ended.set_result(None)

            self.add_done_callback(wake)
            await ended
        how = self._ended
        if isinstance(how, grpc.aio.AioRpcError):
            return how.code()
        return grpc.StatusCode.OK if how == OK else grpc.StatusCode.CANCELLED

    def cancel(self) -> bool:
        if self._ended is not None:
            return False
        self._many.send(self._many.kind.client_frame(stream=self.number, end=True))
        self.end(_CANCELLED)
        return True

    def push(self, message: Any) -> None:
        if self._ended is not None:
            return
        self._inbox.append(message)
        hold_at = self._many.kind.hold_at
        if hold_at and not self._held and len(self._inbox) >= hold_at:
            self._held = True
            self._many.send(self._many.kind.client_frame(stream=self.number, hold=True))
        self._wake()

    def end(self, how: str | grpc.aio.AioRpcError) -> None:
        """The stream is over: ended by the peer (OK or a status), cancelled
        here, or the call failed."""
        if self._ended is not None:
            return
        self._ended = how
        self._many.forget(self.number)
        self._wake()
        callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback(self)

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


class ManyCall:
    """The gateway's one call of a kind to one peer (see the module docstring)."""

    def __init__(self, kind: FrameKind, open_call: Callable[[], grpc.aio.StreamStreamCall],
                 answer_seconds: float = 0.0, on_silent: Callable[[], None] | None = None) -> None:
        """`answer_seconds` > 0: the peer answers a stream's first message at
        once; silence that long fails the call (module docstring)."""
        self.kind = kind
        self._answer_seconds = answer_seconds
        self._on_silent = on_silent
        # Streams whose first message waits for its answer -> when it was sent
        # (insertion order: the oldest first); when the call last heard anything.
        self._owed: dict[int, float] = {}
        self._heard_at = 0.0
        self._watch: asyncio.TimerHandle | None = None
        self._watch_at = 0.0   # when the watch was due
        self._silence: grpc.aio.AioRpcError | None = None
        self._open_call = open_call
        self._call: grpc.aio.StreamStreamCall | None = None
        self._task: asyncio.Task[None] | None = None
        self.ready = False
        self._retry_at = 0.0
        self._streams: dict[int, ManyStream] = {}
        self._next = 0
        self._frames: list[Any] = []
        self._wake: asyncio.Event | None = None

    def ensure(self) -> None:
        """Open the call in the background unless it is open or was tried
        too lately. Call it on the event loop."""
        if self._task is not None:
            return
        loop = asyncio.get_running_loop()
        if loop.time() < self._retry_at:
            return
        self._task = loop.create_task(self._run(), name=self.kind.name)

    def stream(self) -> ManyStream | None:
        """A new stream on the call; None while it is not ready."""
        if not self.ready:
            return None
        self._next += 1
        stream = self._streams[self._next] = ManyStream(self, self._next)
        return stream

    def send(self, frame: Any) -> None:
        self._frames.append(frame)
        if self._wake is not None:
            self._wake.set()

    def forget(self, number: int) -> None:
        self._streams.pop(number, None)
        self._owed.pop(number, None)

    def owe(self, number: int) -> None:
        """Stream `number` sent its first message: its answer is owed."""
        if self._answer_seconds <= 0 or self._call is None:
            return
        loop = asyncio.get_running_loop()
        self._owed[number] = loop.time()
        if self._watch is None:
            self._look_in(self._answer_seconds)

    def _look_in(self, seconds: float) -> None:
        loop = asyncio.get_running_loop()
        self._watch_at = loop.time() + seconds
        self._watch = loop.call_later(seconds, self._check)

    def unanswered_for(self) -> float:
        """Seconds the oldest answer still owed has waited with nothing heard
        on the call since it was asked (0: none such; always 0 unwatched)."""
        self._prune()
        if not self._owed:
            return 0.0
        return asyncio.get_running_loop().time() - next(iter(self._owed.values()))

    def _prune(self) -> None:
        """Forget the owed answers asked before the call last heard anything:
        it was heard since, so they cannot show it silent."""
        owed = self._owed
        while owed and self._heard_at >= next(iter(owed.values())):
            del owed[next(iter(owed))]

    def _check(self) -> None:
        """Fail the call if the oldest owed answer is overdue and the call
        said nothing since it was asked; else look again when the oldest
        owed one falls due."""
        self._watch = None
        if not self._owed or self._call is None:
            return
        loop = asyncio.get_running_loop()
        if loop.time() - self._watch_at > _STALLED_LOOP_SECONDS:
            # This loop itself was stalled: what the peer sent meanwhile may
            # wait unread behind this callback (and behind gRPC's poller
            # thread, on a loaded machine). Judge after the reads, on time.
            self._look_in(max(_REREAD_SECONDS, self._answer_seconds / 2))
            return
        self._prune()
        if not self._owed:
            return
        asked = next(iter(self._owed.values()))
        if loop.time() < asked + self._answer_seconds:
            self._look_in(max(_REREAD_SECONDS, asked + self._answer_seconds - loop.time()))
            return
        log.warning("%s call: no answer to %d stream(s) and nothing else heard for %.1f s; presuming the peer "
                    "gone and moving them", self.kind.name, len(self._owed), loop.time() - asked)
        self._silence = rpc_error(grpc.StatusCode.UNAVAILABLE,
                                  f"the peer said nothing on the {self.kind.name} call for "
                                  f"{self._answer_seconds:g} s while it owed an answer")
        self._call.cancel()
        if self._on_silent is not None:
            self._on_silent()

    async def _run(self) -> None:
        call = self._call = self._open_call()
        failure: grpc.aio.AioRpcError | None = None
        writer: asyncio.Task[None] | None = None
        ending = self.kind.ending
        try:
            if await call.read() is grpc.aio.EOF:
                return
            self._wake = asyncio.Event()
            writer = asyncio.get_running_loop().create_task(self._write_all(call, self._wake), name="many-w")
            self.ready = True
            while True:
                message: Any = await call.read()
                if message is grpc.aio.EOF:
                    return
                self._heard_at = asyncio.get_running_loop().time()
                for frame in message.frames:
                    stream = self._streams.get(frame.stream)
                    if stream is None:
                        continue
                    if self._owed:
                        self._owed.pop(frame.stream, None)
                    if frame.HasField("message"):
                        stream.push(frame.message)
                    how = ending(frame)
                    if how is not None:
                        stream.end(how)
        except grpc.aio.AioRpcError as exc:
            failure = exc
        except asyncio.CancelledError:
            if self._silence is None:
                raise
        finally:
            self._ended(call, writer, self._silence or failure)

    def _ended(self, call: grpc.aio.StreamStreamCall, writer: asyncio.Task[None] | None,
               failure: grpc.aio.AioRpcError | None) -> None:
        """The call is over: fail its streams as broken calls, use
        per-request calls until it is tried again."""
        unimplemented = failure is not None and failure.code() in _NOT_SERVED
        log.debug("%s call ended: %r", self.kind.name, failure)
        if failure is None:
            failure = rpc_error(grpc.StatusCode.UNAVAILABLE, f"the peer ended the {self.kind.name} call")
        self.ready = False
        self._retry_at = asyncio.get_running_loop().time() + (_RETRY_OLD_SECONDS if unimplemented else _RETRY_SECONDS)
        self._call = self._task = self._wake = None
        self._frames = []
        self._owed.clear()
        self._silence = None
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None
        if writer is not None:
            writer.cancel()
        call.cancel()
        for stream in list(self._streams.values()):
            stream.end(failure)
        self._streams.clear()

    async def _write_all(self, call: grpc.aio.StreamStreamCall, wake: asyncio.Event) -> None:
        """Send the frames written since the last message, as one message."""
        try:
            while True:
                await wake.wait()
                wake.clear()
                frames, self._frames = self._frames, []
                if frames:
                    await call.write(self.kind.client_frames(frames=frames))
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as exc:
            log.debug("%s write failed: %r", self.kind.name, exc)
            call.cancel()   # the reader sees the call end and fails the streams

    def close(self) -> None:
        task, self._task = self._task, None
        if self._call is not None:
            self._call.cancel()
        if task is not None:
            task.cancel()
