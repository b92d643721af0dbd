"""The gateway's side of `Scheduler.AdmitMany`: its requests' Admit streams
over one long-lived call per scheduler replica.

An Admit call per request costs the gateway a call set-up and, per message,
a grpc.aio write or read -- most of a short request's CPU here (BENCHMARKS.md
"Short requests"). On this call each request's stream is a `ManyStream`:
its writes become frames that the writer task sends, all those of a loop
turn in one gRPC message, and the reader task hands each stream its frames.
`ManyStream` has the part of a grpc.aio call that `AdmitSession` and
`CallEnder` use (write, read, cancel, done, add_done_callback), with the same
meanings: read returns EOF once the scheduler ended the stream, raises the
call's AioRpcError when the call failed and CancelledError once cancelled
here; so the lease logic above it (lease_link.py) is the same on both.

The call is opened in the background; until the scheduler has answered it
(its empty first message) requests use per-request Admit calls, and so they
do with a scheduler from before AdmitMany (UNIMPLEMENTED, tried again after
`_RETRY_OLD_SECONDS`) and after the call failed (a restart: tried again
after `_RETRY_SECONDS`; its streams fail like broken Admit calls and are
re-admitted or re-attached as such).

Ownership: the `SchedulerClient` owns its `AdmitMany`; everything runs on
the event loop. A `ManyStream` is used by its request's tasks as an Admit
call is (scheduler_client.py).
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable
from typing import Any, cast

import grpc

from services.common.proto.kvmesh.v1 import scheduler_pb2

__all__ = ["AdmitMany", "ManyStream"]

log = logging.getLogger(__name__)

# After the call failed, per-request calls until trying it again.
_RETRY_SECONDS = 1.0
# A scheduler without AdmitMany (UNIMPLEMENTED): try again this much later
# (it may be upgraded in place).
_RETRY_OLD_SECONDS = 30.0

_OK = "ok"
_CANCELLED = "cancelled"


def _copy(err: grpc.aio.AioRpcError) -> grpc.aio.AioRpcError:
    """The call's failure, as each of its streams raises it."""
    return grpc.aio.AioRpcError(err.code(), err.initial_metadata(), err.trailing_metadata(),
                                err.details(), err.debug_error_string())


class ManyStream:
    """One Admit stream on the call (see the module docstring)."""

    __slots__ = ("_many", "number", "_inbox", "_waiter", "_ended", "_callbacks")

    def __init__(self, many: AdmitMany, number: int) -> None:
        self._many = many
        self.number = number
        self._inbox: collections.deque[scheduler_pb2.AdmitServerMessage] = collections.deque()
        self._waiter: asyncio.Future[None] | None = None
        # None while open; then _OK, _CANCELLED or the call's AioRpcError.
        self._ended: str | grpc.aio.AioRpcError | None = None
        self._callbacks: list[Callable[[Any], None]] = []

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
            raise asyncio.InvalidStateError("the Admit stream is already over")
        self._many.send(scheduler_pb2.AdmitClientFrame(
            stream=self.number, message=cast(scheduler_pb2.AdmitClientMessage, message)))

    async def done_writing(self) -> None:
        """Nothing to send: a scheduler with AdmitMany ends a stream at `done`."""

    async def read(self) -> object:
        while not self._inbox:
            ended = self._ended
            if ended == _OK:
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
        return self._inbox.popleft()

    def cancel(self) -> bool:
        if self._ended is not None:
            return False
        self._many.send(scheduler_pb2.AdmitClientFrame(stream=self.number, end=True))
        self.end(_CANCELLED)
        return True

    def push(self, message: scheduler_pb2.AdmitServerMessage) -> None:
        if self._ended is None:
            self._inbox.append(message)
            self._wake()

    def end(self, how: str | grpc.aio.AioRpcError) -> None:
        """The stream is over: ended by the scheduler (_OK), cancelled here,
        or the call failed."""
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


class AdmitMany:
    """The gateway's AdmitMany call to one scheduler (see the module docstring)."""

    def __init__(self, open_call: Callable[[], grpc.aio.StreamStreamCall]) -> None:
        self._open_call = open_call
        self._call: grpc.aio.StreamStreamCall | None = None
        self._task: asyncio.Task[None] | None = None
        self.ready = False
        self._retry_at = 0.0
        self._streams: dict[int, ManyStream] = {}
        self._next = 0
        self._frames: list[scheduler_pb2.AdmitClientFrame] = []
        self._wake: asyncio.Event | None = None

    def ensure(self) -> None:
        """Open the call in the background unless it is open or was tried
        too lately. Call it on the event loop."""
        if self._task is not None:
            return
        loop = asyncio.get_running_loop()
        if loop.time() < self._retry_at:
            return
        self._task = loop.create_task(self._run(), name="admit-many")

    def stream(self) -> ManyStream | None:
        """A new Admit stream on the call; None while it is not ready."""
        if not self.ready:
            return None
        self._next += 1
        stream = self._streams[self._next] = ManyStream(self, self._next)
        return stream

    def send(self, frame: scheduler_pb2.AdmitClientFrame) -> None:
        self._frames.append(frame)
        if self._wake is not None:
            self._wake.set()

    def forget(self, number: int) -> None:
        self._streams.pop(number, None)

    async def _run(self) -> None:
        call = self._call = self._open_call()
        failure: grpc.aio.AioRpcError | None = None
        writer: asyncio.Task[None] | None = None
        try:
            if await call.read() is grpc.aio.EOF:
                return
            self._wake = asyncio.Event()
            writer = asyncio.get_running_loop().create_task(self._write_all(call, self._wake), name="admit-many-w")
            self.ready = True
            while True:
                message = await call.read()
                if message is grpc.aio.EOF:
                    return
                for frame in cast(scheduler_pb2.AdmitServerFrames, message).frames:
                    stream = self._streams.get(frame.stream)
                    if stream is None:
                        continue
                    if frame.HasField("message"):
                        stream.push(frame.message)
                    if frame.end:
                        stream.end(_OK)
        except grpc.aio.AioRpcError as exc:
            failure = exc
        finally:
            self._ended(call, writer, failure)

    def _ended(self, call: grpc.aio.StreamStreamCall, writer: asyncio.Task[None] | None,
               failure: grpc.aio.AioRpcError | None) -> None:
        """The call is over: fail its streams as broken Admit calls, use
        per-request calls until it is tried again."""
        unimplemented = failure is not None and failure.code() == grpc.StatusCode.UNIMPLEMENTED
        log.debug("AdmitMany call ended: %r", failure)
        if failure is None:
            failure = grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                           "the scheduler ended the AdmitMany call")
        self.ready = False
        self._retry_at = asyncio.get_running_loop().time() + (_RETRY_OLD_SECONDS if unimplemented else _RETRY_SECONDS)
        self._call = self._task = self._wake = None
        self._frames = []
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
                    await call.write(scheduler_pb2.AdmitClientFrames(frames=frames))
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as exc:
            log.debug("AdmitMany write failed: %r", exc)
            call.cancel()   # the reader sees the call end and fails the streams

    def close(self) -> None:
        task, self._task = self._task, None
        if self._call is not None:
            self._call.cancel()
        if task is not None:
            task.cancel()
