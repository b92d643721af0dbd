"""The engine's side of `GenerateMany`: a gateway's many Generate streams
over one long-lived call.

Per-call and per-message work dominates a short request's cost in Python
gRPC (BENCHMARKS.md "Short requests"): a Generate call per request costs the
gateway a call set-up, a write or read per message and a status. Here one
call carries every request of a gateway to this engine: each frame is one
message of one Generate stream (numbered by the gateway), and what a loop
turn produces goes out as one gRPC message.

A stream means exactly what a Generate call means: each runs the servicer's
own `Generate` handler in a task of its own, against a `_StreamContext`
standing in for the call's context -- reads are the stream's frames, writes
become frames, `abort` ends the stream with the status the call would have
ended with (the frame's `status`). The gateway's `end` frame is the call
cancelled (the handler's task is cancelled, once it has read what came
before, so a `cancel` right before it is still polite); and when the call
ends, every stream on it is cancelled as a broken call is: its generation
is kept detached for a resume (detached.py). A `hold` frame makes the
stream's writes wait until `release`, as a full HTTP/2 window does, so the
engine coalesces a slow reader's outputs as before; and all streams' writes
wait while the call's own write is stuck with `QUEUED_FRAMES_HIGH` frames
behind it (a gateway that stopped reading altogether sends no `hold`).

Ownership: one `GenerateManyCall` per call. Its handler task writes the
frames; its reader task reads frames and starts and feeds the streams' tasks;
all on the engine's event loop.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Awaitable, Callable
from typing import Any, NoReturn

import grpc

from services.common.many_server import ManyServerCall
from services.common.proto.kvmesh.v1 import engine_pb2

__all__ = ["GenerateManyCall"]

log = logging.getLogger(__name__)

# After the gateway's `end`, how long the handler may take to read what came
# before it (a `cancel`) before it is cancelled anyway.
_END_READ_SECONDS = 1.0

Handler = Callable[[object, Any], Awaitable[None]]


class _StreamContext:
    """One Generate stream on the call, standing in for the call's
    ServicerContext (read, write, abort, invocation_metadata)."""

    def __init__(self, call: GenerateManyCall, number: int) -> None:
        self._call = call
        self.number = number
        self._inbox: collections.deque[engine_pb2.EngineGenerateMessage] = collections.deque()
        self._waiter: asyncio.Future[None] | None = None
        self._released = asyncio.Event()
        self._released.set()
        self.ending = False   # the gateway ended it: cancel once its inbox is read
        self.status: tuple[grpc.StatusCode, str] | None = None
        self.task: asyncio.Task[None] | None = None

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._call.metadata

    async def read(self) -> object:
        while not self._inbox:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        message = self._inbox.popleft()
        if self.ending and not self._inbox:
            asyncio.get_running_loop().call_soon(self.cancel)
        return message

    async def write(self, message: engine_pb2.EngineGenerateEvent) -> None:
        if not self._released.is_set():
            await self._released.wait()
        await self._call.room()
        self._call.queue(engine_pb2.GenerateServerFrame(stream=self.number, message=message))

    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata: object = ()) -> NoReturn:
        self.status = (code, details)
        raise grpc.aio.AbortError()

    def push(self, message: engine_pb2.EngineGenerateMessage) -> None:
        self._inbox.append(message)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def hold(self, held: bool) -> None:
        if held:
            self._released.clear()
        else:
            self._released.set()

    def end(self) -> None:
        """The gateway ended the stream (a cancelled call)."""
        if not self._inbox:
            self.cancel()
            return
        self.ending = True
        asyncio.get_running_loop().call_later(_END_READ_SECONDS, self.cancel)

    def cancel(self) -> None:
        if self.task is not None:
            self.task.cancel()


class GenerateManyCall(ManyServerCall):
    """One GenerateMany call (see the module docstring)."""

    def __init__(self, handler: Handler, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        super().__init__(context, engine_pb2.GenerateServerFrames)
        self._handler = handler   # the servicer's `Generate`
        self._open: dict[int, _StreamContext] = {}
        self._highest = 0   # stream numbers only grow: a lower unknown one is a late frame
        self.metadata: tuple[tuple[str, str], ...] = tuple(
            (k, v) for k, v in (context.invocation_metadata() or ()) if isinstance(v, str))

    def streams_open(self) -> bool:
        return bool(self._open)

    def streams_ended(self) -> None:
        for stream in list(self._open.values()):
            stream.cancel()   # as a broken call: kept detached for a resume

    def on_frame(self, frame: engine_pb2.GenerateClientFrame) -> None:
        stream = self._open.get(frame.stream)
        if stream is None:
            if frame.stream <= self._highest or not frame.HasField("message"):
                return   # a late frame of a stream already ended here
            self._highest = frame.stream
            stream = self._open[frame.stream] = _StreamContext(self, frame.stream)
            stream.task = asyncio.get_running_loop().create_task(self._run(stream))
        if frame.HasField("message"):
            stream.push(frame.message)
        if frame.hold or frame.release:
            stream.hold(frame.hold)
        if frame.end:
            stream.end()

    async def _run(self, stream: _StreamContext) -> None:
        """The stream's Generate handler; its ending becomes the end frame."""
        status: engine_pb2.StreamStatus | None = None
        try:
            await self._handler(None, stream)
        except grpc.aio.AbortError:
            code, details = stream.status or (grpc.StatusCode.UNKNOWN, "")
            status = engine_pb2.StreamStatus(code=code.value[0], details=details)
        except asyncio.CancelledError:
            return   # cancelled by the gateway or the call's end: nothing to say
        except Exception as exc:   # as grpc ends a call whose handler raised
            log.exception("GenerateMany stream %d failed", stream.number)
            status = engine_pb2.StreamStatus(code=grpc.StatusCode.UNKNOWN.value[0],
                                             details=f"Unexpected {type(exc).__name__}: {exc}")
        finally:
            self._open.pop(stream.number, None)
            self.stream_closed()
        self.queue(engine_pb2.GenerateServerFrame(stream=stream.number, end=True, status=status))
