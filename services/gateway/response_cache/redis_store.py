"""The shared store: one Redis for every gateway (redis.asyncio).

Entries are `SET <key_prefix><key> <value> EX <ttl_seconds>`: Redis expires
them, and its own `maxmemory` policy bounds its memory; this side bounds each
value (`max_entry_bytes`, checked by the cache before `put`) and counts the
bytes it wrote that have not expired yet (per second of expiry, so the
bookkeeping is at most `ttl_seconds` numbers however many entries).

Failures: every call is bounded by `op_timeout_seconds` (connect by
`connect_timeout_seconds`), with no client-side retries; a failure raises
to the cache (which counts it and treats it as a miss). `breaker.Breaker`
stops asking a Redis that keeps failing, so a dead one costs no timeout per
request; it is tried again `breaker_reset_seconds` later.
"""

from __future__ import annotations

import asyncio
import math
from collections import deque
from collections.abc import Awaitable, Callable
from typing import TypeVar

from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from services.common.clock import Clock
from services.common.config.response_cache import ResponseCacheConfig
from services.gateway.response_cache.breaker import Breaker
from services.gateway.response_cache.metrics import CacheMetrics

__all__ = ["RedisStore", "StoreUnavailable", "redis_client"]

T = TypeVar("T")


def redis_client(config: ResponseCacheConfig) -> Redis:
    """A client on `config.redis_url` whose every call is bounded by the
    configured timeouts and never retried (the caller's breaker decides)."""
    return Redis.from_url(
        config.redis_url, socket_connect_timeout=config.connect_timeout_seconds,
        socket_timeout=config.op_timeout_seconds, retry=Retry(NoBackoff(), 0), retry_on_timeout=False,
        health_check_interval=0)


class StoreUnavailable(Exception):
    """The breaker is open: the store was not asked."""


class RedisStore:
    name = "redis"

    def __init__(self, config: ResponseCacheConfig, clock: Clock, metrics: CacheMetrics) -> None:
        self._prefix = config.key_prefix
        self._ttl = max(1, math.ceil(config.ttl_seconds))
        self._timeout = config.op_timeout_seconds
        self._clock = clock
        self._metrics = metrics
        self.breaker = Breaker(config.breaker_failures, config.breaker_reset_seconds, clock)
        self._client = redis_client(config)
        self._written: deque[list[float]] = deque()   # [expiry second, bytes], oldest first
        self._bytes = 0

    async def _call(self, op: Callable[[], Awaitable[T]]) -> T:
        if not self.breaker.allow():
            raise StoreUnavailable("the Redis circuit breaker is open")
        try:
            async with asyncio.timeout(self._timeout):
                result = await op()
        except BaseException:
            self.breaker.failure()   # also a cancelled call: a half-open probe must end
            raise
        self.breaker.success()
        return result

    async def get(self, key: str) -> bytes | None:
        value = await self._call(lambda: self._client.get(self._prefix + key))
        if value is None or isinstance(value, bytes):
            return value
        return str(value).encode()

    async def put(self, key: str, value: bytes) -> None:
        await self._call(lambda: self._client.set(self._prefix + key, value, ex=self._ttl))
        self._count_written(len(value))

    def _count_written(self, size: int) -> None:
        now = self._clock.wall()
        while self._written and self._written[0][0] <= now:
            self._bytes -= int(self._written.popleft()[1])
        expiry = float(math.ceil(now + self._ttl))
        if self._written and self._written[-1][0] == expiry:
            self._written[-1][1] += size
        else:
            self._written.append([expiry, float(size)])
        self._bytes += size
        self._metrics.bytes.set(self._bytes)

    @property
    def size_bytes(self) -> int:
        return self._bytes

    async def aclose(self) -> None:
        await self._client.aclose()
