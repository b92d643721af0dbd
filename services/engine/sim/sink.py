"""`OutputSink`: where a simulated request's outputs wait for its reader
(sim/backend.py's `generate`); filled by the core's step (sim/core.py)."""

from __future__ import annotations

import asyncio

from services.engine.backend import GenerationOutput

__all__ = ["OutputSink"]


class OutputSink:
    """Where a request's outputs wait for its reader. Tokens produced while
    the reader is busy are merged into one pending output (never dropped,
    one pending record per request whatever the reader's speed)."""

    __slots__ = ("_ids", "_text", "_held", "_logprobs", "_final", "_error", "_event")

    def __init__(self) -> None:
        self._ids: list[int] = []
        self._text: list[str] = []
        self._held = ""
        self._logprobs: list[dict] | None = None
        self._final: GenerationOutput | None = None
        self._error: Exception | None = None  # the backend failed: raised by next()
        self._event = asyncio.Event()

    def push(self, token_id: int, text: str, logprob: dict | None, held: str = "") -> None:
        self._ids.append(token_id)
        self._text.append(text)
        self._held = held
        if logprob is not None:
            self._logprobs = self._logprobs or []
            self._logprobs.append(logprob)
        self._event.set()

    def finish(self, final: GenerationOutput) -> None:
        if self._final is None:
            self._final = final
            self._event.set()

    def fail(self, error: Exception) -> None:
        self._error = error
        self._event.set()

    @property
    def finished(self) -> bool:
        return self._final is not None

    async def next(self) -> GenerationOutput:
        while not self._ids and self._final is None:
            if self._error is not None:
                raise self._error
            self._event.clear()
            await self._event.wait()
        out = GenerationOutput(token_ids=self._ids, text="".join(self._text), logprobs=self._logprobs,
                               held_text="" if self._final is not None else self._held)
        self._ids, self._text, self._logprobs = [], [], None
        if self._final is not None:
            out.finish_reason = self._final.finish_reason
            out.text += self._final.text
            out.prompt_tokens = self._final.prompt_tokens
            out.cached_tokens = self._final.cached_tokens
            out.completion_tokens = self._final.completion_tokens
            out.message = self._final.message
        return out
