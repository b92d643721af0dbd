"""Reading OpenAI-style SSE bodies: the one parser kvmesh's clients share
(kvmesh bench, the benchmark and chaos scripts, the mesh tests)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp

__all__ = ["SseEvents"]


class SseEvents:
    """The JSON `data:` events of one SSE response, in order.

    Comments (heartbeats) and blank lines are skipped; iteration ends at
    `data: [DONE]` (then `done` is True) or when the body ends without it.
    `last_id` is the last `id:` seen (a resume's Last-Event-ID), or None.
    """

    def __init__(self, content: aiohttp.StreamReader) -> None:
        self._content = content
        self.done = False
        self.last_id: str | None = None

    def __aiter__(self) -> AsyncIterator[dict[str, Any]]:
        return self._events()

    async def _events(self) -> AsyncIterator[dict[str, Any]]:
        async for raw in self._content:
            line = raw.strip()
            if line.startswith(b"id:"):
                self.last_id = line[3:].strip().decode()
                continue
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                self.done = True
                return
            yield json.loads(data)
