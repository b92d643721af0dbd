"""Backpressure by coalescing: a per-request buffer between the backend
(which must never wait for a slow reader) and the transport writer.

It holds at most ONE pending output: whatever the backend produces while the
writer is busy is merged into it (token ids, text and logprobs appended,
finish fields taken from the last output). Nothing is ever dropped, and the
buffer's size is bounded by the request's own max_tokens -- not by how slow
the reader is.

The writer may also hold a stream back on purpose (`StreamPacing`): under
load, one message per token per stream costs every hop of the mesh (engine
write, gateway read and SSE write, Envoy) CPU that the model needs; paced,
the tokens of a few steps travel as one delta.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from services.engine.backend import GenerationOutput

__all__ = ["DeltaBuffer", "StreamPacing"]


@dataclass(frozen=True)
class StreamPacing:
    """While at least `min_running` generations are in the backend, a
    stream's deltas go out at most every `interval_seconds`, unless its
    priority class is in `unpaced_priorities`. The first token and the final
    output are never held."""

    interval_seconds: float = 0.0
    min_running: int = 1
    unpaced_priorities: frozenset[int] = frozenset()

    def hold_seconds(self, live: int, priority: int = 1) -> float:
        """How long to hold a stream of class `priority` after a delta went
        out, with `live` generations in the backend (0 = send the next one as
        soon as it exists)."""
        if self.interval_seconds <= 0 or live < self.min_running or priority in self.unpaced_priorities:
            return 0.0
        return self.interval_seconds


class DeltaBuffer:
    def __init__(self) -> None:
        self._pending: GenerationOutput | None = None
        self._error: BaseException | None = None
        self._event = asyncio.Event()
        self.closed = False  # a final output or an error is in (or was taken)
        # The writer waits out a pacing hold: only the final output (or an
        # error) wakes it early, not every token pushed meanwhile.
        self._holding = False

    def push(self, out: GenerationOutput) -> None:
        if self.closed:
            return  # after the final output nothing more belongs to the stream
        if self._pending is None:
            self._pending = GenerationOutput(
                token_ids=list(out.token_ids), text=out.text,
                logprobs=list(out.logprobs) if out.logprobs else None, held_text=out.held_text,
            )
        else:
            self._pending.token_ids.extend(out.token_ids)
            self._pending.text += out.text
            self._pending.held_text = out.held_text  # what is held after the newest token
            if out.logprobs:
                self._pending.logprobs = (self._pending.logprobs or []) + list(out.logprobs)
        if out.finish_reason is not None:
            p = self._pending
            p.finish_reason, p.message = out.finish_reason, out.message
            p.prompt_tokens, p.cached_tokens = out.prompt_tokens, out.cached_tokens
            p.completion_tokens = out.completion_tokens
            self.closed = True
        if not self._holding or self.closed:
            self._event.set()

    def fail(self, error: BaseException) -> None:
        if not self.closed:
            self._error = error
            self.closed = True
            self._event.set()

    def pending_tokens(self) -> int:
        return len(self._pending.token_ids) if self._pending else 0

    async def take(self, hold_seconds: float = 0.0) -> GenerationOutput:
        """The merged pending output; raises the backend's error, if any,
        after every output that came before it. With `hold_seconds`, wait
        that long first (merging what arrives meanwhile) unless the stream
        ends sooner."""
        if hold_seconds > 0 and not self.closed:
            loop = asyncio.get_running_loop()
            self._holding = True
            self._event.clear()
            timer = loop.call_later(hold_seconds, self._event.set)
            try:
                await self._event.wait()
            finally:
                timer.cancel()
                self._holding = False
        while self._pending is None and self._error is None:
            self._event.clear()
            await self._event.wait()
        if self._pending is not None:
            out, self._pending = self._pending, None
            return out
        error, self._error = self._error, None
        if error is None:  # pragma: no cover - guarded by the loop above
            raise RuntimeError("DeltaBuffer.take without output")
        raise error
