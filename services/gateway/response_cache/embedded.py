"""The embedded store: entries in this gateway's memory, least recently used
first out when `max_bytes` would be exceeded, each served for `ttl_seconds`.

Owned by the event loop's thread (no locks): every method is synchronous
and short; the async `get`/`put` of the `CacheStore` contract just call them.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from services.common.clock import Clock
from services.gateway.response_cache.metrics import CacheMetrics

__all__ = ["EmbeddedStore"]


@dataclass
class _Entry:
    value: bytes
    expires: float   # monotonic


class EmbeddedStore:
    name = "embedded"

    def __init__(self, max_bytes: int, ttl_seconds: float, clock: Clock, metrics: CacheMetrics) -> None:
        self._max_bytes = max_bytes
        self._ttl = ttl_seconds
        self._clock = clock
        self._metrics = metrics
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._bytes = 0

    @property
    def size_bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    async def get(self, key: str) -> bytes | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        if entry.expires <= self._clock.monotonic():
            self._drop(key)
            return None
        self._entries.move_to_end(key)
        return entry.value

    async def put(self, key: str, value: bytes) -> None:
        if len(value) > self._max_bytes:
            return
        if key in self._entries:
            self._drop(key)
        now = self._clock.monotonic()
        self._expire(now)
        while self._entries and self._bytes + len(value) > self._max_bytes:
            self._drop(next(iter(self._entries)))
            self._metrics.evictions.inc()
        self._entries[key] = _Entry(value, now + self._ttl)
        self._set_bytes(self._bytes + len(value))

    def _expire(self, now: float) -> None:
        """Drop expired entries from the LRU end (oldest use first) until
        one is still fresh: cheap, and what is left expires on `get`."""
        while self._entries:
            key, entry = next(iter(self._entries.items()))
            if entry.expires > now:
                return
            self._drop(key)

    def _drop(self, key: str) -> None:
        entry = self._entries.pop(key)
        self._set_bytes(self._bytes - len(entry.value))

    def _set_bytes(self, value: int) -> None:
        self._bytes = value
        self._metrics.bytes.set(value)

    async def aclose(self) -> None:
        self._entries.clear()
        self._set_bytes(0)
