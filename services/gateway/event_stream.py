"""Between one request's driver and its transport: a bounded queue, heartbeats
and the gateway side of backpressure by coalescing.

Signals (`StreamSignals`, the gateway's metrics): each heartbeat sent; a
stream is *paced* from the moment its queue is full when the driver has
another event (the client reads slower than tokens arrive: the pump waits,
deltas merge, the engine coalesces) until the transport finds the queue
empty again; the first time counts it as a slow reader.

Ownership: `EventStream` starts the request's ONE pump task, which runs the
driver and alone owns the request's state (its Admit stream, engine call and
generated tokens). The transport only iterates the stream (and calls
`mark_output` / `aclose`). Backpressure: a slow client stops iterating, the
full queue stops the pump, the pump stops reading from the engine, and the
engine coalesces. Closing the stream before its end (client gone) cancels
the pump task, which cancels the engine call and the Admit call at once.
Closing it after the last event does not: the pump is only tidying up then
(acknowledging the engine, letting the scheduler end the Admit stream), and
a call cancelled while its last message is unread at the peer loses that
message -- the scheduler's `done` (tests/unit/gateway/test_last_messages.py).
The tidy-up is handed to `keep` and ends by itself (its steps are bounded).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import cast

from services.common.clock import Clock
from services.gateway.errors import ErrorKind, GatewayError
from services.gateway.events import Emit, Event, Finished, Heartbeat, QueuedUpdate, TextDelta
from services.gateway.metrics import StreamSignals

__all__ = ["EventStream"]

log = logging.getLogger(__name__)

# Events queued between the pump and the transport. Small on purpose: the
# engine coalesces when we fall behind, so a deep buffer only adds memory.
_QUEUE_DEPTH = 8


class EventStream:
    """Runs a driver in its own task behind a bounded queue, and adds
    heartbeats: if nothing was sent for `heartbeat_seconds`, iteration yields
    `Heartbeat()`. Iteration ends after `Finished`. Always `aclose()` it
    (cancels the driver if still running)."""

    _END = object()
    # False for a stream no engine keeps (a response cache replay): the SSE
    # transport then sends no resume ids (`Last-Event-ID` could find nothing).
    resumable = True

    def __init__(
        self, run: Callable[[Emit], Awaitable[None]], heartbeat_seconds: float, clock: Clock,
        before_close: Callable[[], Awaitable[None]] | None = None, signals: StreamSignals | None = None,
        keep: Callable[[asyncio.Task[None]], None] | None = None,
    ) -> None:
        """`keep`: holds the pump task while it tidies up after the last
        event (without it, `aclose` cancels it as before the end)."""
        # Awaited by `aclose` before it cancels a driver still running.
        self._before_close = before_close
        self._queue: asyncio.Queue[object] = asyncio.Queue(_QUEUE_DEPTH)
        self._heartbeat = heartbeat_seconds
        self._clock = clock
        self._last_output = clock.monotonic()
        # An event taken from the queue while merging deltas, yielded next.
        self._held: object | None = None
        self._signals = signals
        self._paced = False
        self._was_paced = False
        self._keep = keep
        self._ended = False   # the last event was taken: the pump only tidies up
        self._task = asyncio.create_task(self._pump(run))

    async def _pump(self, run: Callable[[Emit], Awaitable[None]]) -> None:
        try:
            await run(self._put)
        except GatewayError as exc:
            await self._queue.put(exc)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.exception("generation driver failed")
            await self._queue.put(GatewayError(ErrorKind.INTERNAL, f"internal error: {type(exc).__name__}"))
        await self._queue.put(self._END)

    async def _put(self, event: QueuedUpdate | TextDelta | Finished) -> None:
        if not self._paced and self._queue.full():
            self._set_paced(True)
        await self._queue.put(event)

    def _set_paced(self, paced: bool) -> None:
        self._paced = paced
        if self._signals is not None:
            self._signals.paced(paced, first=paced and not self._was_paced)
        self._was_paced |= paced

    def mark_output(self) -> None:
        """The transport wrote something: restart the heartbeat timer."""
        self._last_output = self._clock.monotonic()

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
                if self._paced:
                    self._set_paced(False)  # the client caught up
                wait = self._last_output + self._heartbeat - self._clock.monotonic()
                try:
                    async with asyncio.timeout(max(wait, 0.0)):
                        item = await self._queue.get()
                except TimeoutError:
                    self.mark_output()
                    if self._signals is not None:
                        self._signals.heartbeat()
                    yield Heartbeat()
                    continue
            if item is self._END:
                return
            if isinstance(item, GatewayError):
                raise item
            if isinstance(item, TextDelta) and not self._queue.empty():
                item = self._merge_queued(item)
            if isinstance(item, Finished) and item.final:
                self._ended = True
                yield item
                return  # the last event; the pump only tidies up after it
            yield cast(Event, item)  # what is left in the queue: the driver's events

    def _merge_queued(self, first: TextDelta) -> TextDelta:
        """Backpressure by coalescing, gateway side: deltas that queued up
        while the transport was writing go out as ONE event (one JSON encode,
        one SSE write), in order, nothing dropped. The first other event is
        held back and yielded next."""
        texts, ids, logprobs = [first.text], list(first.token_ids), list(first.logprobs)
        index = first.index
        while True:
            try:
                item = self._queue.get_nowait()
            except asyncio.QueueEmpty:
                break
            if not isinstance(item, TextDelta) or item.choice != first.choice:
                self._held = item
                break
            texts.append(item.text)
            ids.extend(item.token_ids)
            logprobs.extend(item.logprobs)
            index = item.index
        return TextDelta("".join(texts), ids, logprobs, index, first.choice)

    async def aclose(self) -> None:
        if self._paced:
            self._set_paced(False)
        if self._ended and self._keep is not None and not self._task.done():
            self._keep(self._task)
            return
        if not self._task.done():
            if self._before_close is not None:
                try:
                    await self._before_close()
                except Exception:
                    log.debug("before_close failed", exc_info=True)
            self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
