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


class ManyServerCall:
    """Frames out and in of one call (see the module docstring)."""

    def __init__(self, context: grpc.aio.ServicerContext[Any, Any], frames_message: Callable[..., Any]) -> None:
        self._context = context
        self._frames_message = frames_message   # (frames=[...]) -> one gRPC message
        self._frames: list[Any] = []
        self.flushes = 0     # gRPC messages written: numbers the next one
        self._wake = asyncio.Event()
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
        self._wake.set()

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
                self.flushes += 1
                await self._context.write(self._frames_message(frames=frames))
        finally:
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
