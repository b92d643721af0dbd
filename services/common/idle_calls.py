"""Server side of calls opened ahead of need.

Gateways keep one Admit and one Generate call open per destination before a
request needs it (`services.gateway.spare_calls`). Such a call's handler
waits for its first message, possibly for a long time. On stop they must end
at once: left alone they would hold the server's grace period open while
carrying no work at all.
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc

__all__ = ["IdleCalls"]


class IdleCalls:
    """Handlers waiting for their call's first message; `close` ends them."""

    def __init__(self) -> None:
        self._waiting: set[asyncio.Future[Any]] = set()
        self.closed = False

    async def first_message(self, context: grpc.aio.ServicerContext) -> Any:
        """The call's first message, or grpc.aio.EOF. After `close` -- and
        for a handler waiting when it comes -- the call ends UNAVAILABLE, and
        the client opens a fresh call wherever it goes next."""
        if not self.closed:
            read = asyncio.ensure_future(context.read())
            self._waiting.add(read)
            try:
                return await read
            except asyncio.CancelledError:
                if not (self.closed and read.cancelled()):
                    raise  # the handler itself was cancelled: the client left
            finally:
                self._waiting.discard(read)
        await context.abort(grpc.StatusCode.UNAVAILABLE, "the server is stopping")

    def close(self) -> None:
        self.closed = True
        for read in list(self._waiting):
            read.cancel()
