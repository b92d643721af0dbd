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
        # The handlers' own tasks, each while it waits: the read runs in the
        # handler's task, not a task of its own (one task and one loop turn
        # less per request; every request's call starts here).
        self._waiting: set[asyncio.Task[Any]] = set()
        self.closed = False

    async def first_message(self, context: grpc.aio.ServicerContext) -> Any:
        """The call's first message, or grpc.aio.EOF. After `close` -- and
        for a handler waiting when it comes -- the call ends UNAVAILABLE, and
        the client opens a fresh call wherever it goes next."""
        task = asyncio.current_task()
        if not self.closed and task is not None:
            self._waiting.add(task)
            try:
                return await context.read()
            except asyncio.CancelledError:
                if not self.closed:
                    raise  # the handler itself was cancelled: the client left
                task.uncancel()   # `close` cancelled the wait: end the call below
            finally:
                self._waiting.discard(task)
        await context.abort(grpc.StatusCode.UNAVAILABLE, "the server is stopping")

    def close(self) -> None:
        self.closed = True
        for task in list(self._waiting):
            task.cancel()
