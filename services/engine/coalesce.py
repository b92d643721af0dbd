"""Backpressure by coalescing: a per-request buffer between the backend
(which must never wait for a slow reader) and the transport writer.

It holds at most ONE pending output: whatever the backend produces while the
writer is busy is merged into it (token ids, text and logprobs appended,
finish fields taken from the last output). Nothing is ever dropped, and the
buffer's size is bounded by the request's own max_tokens -- not by how slow
the reader is.
"""

from __future__ import annotations

import asyncio

from services.engine.backend import GenerationOutput

__all__ = ["DeltaBuffer"]


class DeltaBuffer:
    def __init__(self) -> None:
        self._pending: GenerationOutput | None = None
        self._error: BaseException | None = None
        self._event = asyncio.Event()
        self.closed = False  # a final output or an error is in (or was taken)

    def push(self, out: GenerationOutput) -> None:
        if self.closed:
            return  # after the final output nothing more belongs to the stream
        if self._pending is None:
            self._pending = GenerationOutput(
                token_ids=list(out.token_ids), text=out.text,
                logprobs=list(out.logprobs) if out.logprobs else None,
            )
        else:
            self._pending.token_ids.extend(out.token_ids)
            self._pending.text += out.text
            if out.logprobs:
                self._pending.logprobs = (self._pending.logprobs or []) + list(out.logprobs)
        if out.finish_reason is not None:
            p = self._pending
            p.finish_reason, p.message = out.finish_reason, out.message
            p.prompt_tokens, p.cached_tokens = out.prompt_tokens, out.cached_tokens
            p.completion_tokens = out.completion_tokens
            self.closed = True
        self._event.set()

    def fail(self, error: BaseException) -> None:
        if not self.closed:
            self._error = error
            self.closed = True
            self._event.set()

    def pending_tokens(self) -> int:
        return len(self._pending.token_ids) if self._pending else 0

    async def take(self) -> GenerationOutput:
        """The merged pending output; raises the backend's error, if any,
        after every output that came before it."""
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
