"""One gRPC bidi call opened ahead of need, per destination.

Opening a grpc.aio stream costs the gateway ~0.15 ms of Python and the server
~0.3 ms more before it reads the first message (HTTP/2 stream, call objects,
the handler's task). A request pays that twice on its way to the first token:
for its Admit stream and for its engine's Generate stream. A spare call
opened after the previous request's first token moves that work off the
time-to-first-token path: the next request only writes its first message.

Both protocols are built for it: the first client message carries the whole
request, so an opened call is bound to nothing until then. Servers end spare
calls at once when they stop (`services.common.idle_calls.IdleCalls`).

Single event loop, no locking: `take` and `replenish` are synchronous.
"""

from __future__ import annotations

from collections.abc import Callable

import grpc

__all__ = ["SpareCall"]


class SpareCall:
    """At most one pre-opened call from `open_call`. `take` hands it out if
    it is still alive (else opens a fresh one); `replenish` opens the next."""

    def __init__(self, open_call: Callable[[], grpc.aio.StreamStreamCall]) -> None:
        self._open = open_call
        self._spare: grpc.aio.StreamStreamCall | None = None

    def take(self) -> grpc.aio.StreamStreamCall:
        spare, self._spare = self._spare, None
        if spare is not None:
            if not spare.done():
                return spare
            spare.cancel()  # ended by the server (restart, stop): never hand it out
        return self._open()

    def replenish(self) -> None:
        """Open a spare if there is none alive. Call it off the latency path
        (after a request's first token), never while a request waits."""
        if self._spare is not None and not self._spare.done():
            return
        self._spare = self._open()

    def discard(self) -> None:
        spare, self._spare = self._spare, None
        if spare is not None:
            spare.cancel()
