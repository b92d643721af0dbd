"""The server's side of a call carrying many numbered streams (the
scheduler's `AdmitMany`, the engine's `GenerateMany`): the frame writer and
reader both share.

The handler task writes: first the empty "served" message, then, each loop
turn, every frame queued since as one gRPC message. A reader task reads the
client's messages and hands each frame to `on_frame`, synchronously. The
call ends when the client stops sending (EOF, a broken read: every stream
ends as on a broken call), with INVALID_ARGUMENT when it sent bytes that are
no frames, and UNAVAILABLE once `close` was called and no stream is open.

Ownership: one per call, on the server's event loop; subclasses own the streams.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import grpc

from services.common.grpc_guard import UndecodableMessage

__all__ = ["ManyServerCall"]

log = logging.getLogger(__name__)

# Frames queued behind a write that waits (a client reading slowly, or not
# at all: a wedged gateway until keepalive ends the call): from this many
# on, the streams' own writes (`room`) wait, as on a full HTTP/2 window, and
# an engine coalesces each stream's outputs meanwhile. What the server
# queues itself (a stream's end) never waits; so at most about twice this
# many frames are held for one call.
QUEUED_FRAMES_HIGH = 512


class ManyServerCall:
    """Frames out and in of one call (see the module docstring)."""

    def __init__(self, context: grpc.aio.ServicerContext[Any, Any], frames_message: Callable[..., Any]) -> None:
        self._context = context
        self._frames_message = frames_message   # (frames=[...]) -> one gRPC message
        self._frames: list[Any] = []
        self.flushes = 0     # gRPC messages written: numbers the next one
        self._wake = asyncio.Event()
        self._room = asyncio.Event()
        self._room.set()
        self._reading = True
        self._closing = False
        self._undecodable = ""

    def close(self) -> None:
        """The server stops: end the call once its streams have ended (at
        once if it has none)."""
        self._closing = True
        self._wake.set()

    def queue(self, frame: object) -> None:
        """Send `frame` with the rest of this loop turn's."""
        self._frames.append(frame)
        if len(self._frames) >= QUEUED_FRAMES_HIGH:
            self._room.clear()
        self._wake.set()

    @property
    def queued(self) -> int:
        """Frames waiting for the next write."""
        return len(self._frames)

    async def room(self) -> None:
        """Wait while the frames queued behind a pending write are at the
        bound (a stream's write calls it first)."""
        if not self._room.is_set():
            await self._room.wait()

    def streams_open(self) -> bool:
        raise NotImplementedError

    def on_frame(self, frame: Any) -> None:
        raise NotImplementedError

    def streams_ended(self) -> None:
        """The call is over: end the streams still open."""
        raise NotImplementedError

    def stream_closed(self) -> None:
        """A stream ended: a closing call may end now."""
        if self._closing and not self.streams_open():
            self._wake.set()

    async def serve(self) -> None:
        reader = asyncio.create_task(self._read_all())
        try:
            await self._context.write(self._frames_message())   # "served"
            while True:
                if not self._frames:
                    if not self._reading:
                        if self._undecodable:
                            await self._context.abort(grpc.StatusCode.INVALID_ARGUMENT, self._undecodable)
                        return
                    if self._closing and not self.streams_open():
                        await self._context.abort(grpc.StatusCode.UNAVAILABLE, "the server is stopping")
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                frames, self._frames = self._frames, []
                self._room.set()
                self.flushes += 1
                await self._context.write(self._frames_message(frames=frames))
        finally:
            self._room.set()   # writers waiting here go on to find the call over
            reader.cancel()
            self.streams_ended()

    async def _read_all(self) -> None:
        try:
            while True:
                message: Any = await self._context.read()
                if message is grpc.aio.EOF:
                    return
                for frame in message.frames:
                    self.on_frame(frame)
        except asyncio.CancelledError:
            raise
        except UndecodableMessage as exc:   # garbage, not a gateway: say so (grpc_guard.py)
            self._undecodable = str(exc)
        except Exception as exc:  # noqa: BLE001 - a broken read is the client leaving
            log.debug("%s: read ended: %r", type(self).__name__, exc)
        finally:
            self._reading = False
            self._wake.set()
