"""The Responses store every gateway sees: the Redis the response cache uses
(`gateway.response_cache.redis_url`, its timeouts and breaker settings).

Layout, under `responses.key_prefix` (P):

    P<key id>:<response id>    the entry: JSON {"response", "history"}, SET EX ttl_seconds
    P<key id>:ids              that API key's response ids, oldest first (EXPIRE ttl_seconds)

Scoped to the key: the key id is part of every entry's name, so another
key's lookup misses (the same 404 as an unknown id). Bounded: one Lua
script stores an entry, appends its id to the key's list and trims that list
to `max_entries`, deleting the entries it drops -- atomically, so two
gateways storing at once cannot leave the list longer than the bound. Every
entry has a TTL, so Redis' `maxmemory` with a `volatile-*` policy bounds
the total (README "Responses API").

When Redis cannot answer (down, a timeout, the breaker open): reads and
deletes fail with StoreUnavailable, which the API answers 503
`responses_store_unavailable` with Retry-After -- not 404, since the
response may well exist, and not a fall-back to this gateway's memory, which
would answer 404 for every turn another gateway stored (the very bug this
store removes). A response that cannot be stored is still returned to its
client (the generation is done); the API logs it, and its continuation gets
the same 503 or a 404. The breaker (response_cache/breaker.py) stops asking a
Redis that keeps failing, so a dead one costs no timeout per request.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from services.common.clock import Clock
from services.common.config.response_cache import ResponseCacheConfig
from services.common.config.responses import ResponsesConfig
from services.gateway.response_cache.breaker import Breaker
from services.gateway.response_cache.redis_store import redis_client
from services.gateway.responses_store import StoredResponse, StoreUnavailable

__all__ = ["RedisResponses"]

T = TypeVar("T")

# KEYS: the entry, the key's id list. ARGV: value, ttl, max entries, the
# response id, the entry name prefix (P<key id>:).
_PUT = """
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
redis.call('LREM', KEYS[2], 0, ARGV[4])
redis.call('RPUSH', KEYS[2], ARGV[4])
redis.call('EXPIRE', KEYS[2], ARGV[2])
local over = redis.call('LLEN', KEYS[2]) - tonumber(ARGV[3])
for _ = 1, over do
  redis.call('DEL', ARGV[5] .. redis.call('LPOP', KEYS[2]))
end
return over
"""


class RedisResponses:
    def __init__(self, config: ResponsesConfig, redis: ResponseCacheConfig, clock: Clock) -> None:
        self._config = config
        self._ttl = max(1, math.ceil(config.ttl_seconds))
        self._timeout = config.op_timeout_seconds
        self._retry_after = redis.breaker_reset_seconds
        self._clock = clock
        self.breaker = Breaker(redis.breaker_failures, redis.breaker_reset_seconds, clock)
        self._client = redis_client(dataclasses.replace(
            redis, op_timeout_seconds=config.op_timeout_seconds,
            connect_timeout_seconds=max(redis.connect_timeout_seconds, config.op_timeout_seconds)))
        self._put = self._client.register_script(_PUT)

    @property
    def enabled(self) -> bool:
        return self._config.max_entries > 0

    def _names(self, owner: str, response_id: str = "") -> tuple[str, str, str]:
        """(entry, id list, entry prefix) of `owner`'s `response_id`."""
        prefix = f"{self._config.key_prefix}{owner}:"
        return f"{prefix}{response_id}", f"{prefix}ids", prefix

    async def _call(self, op: Callable[[], Awaitable[T]]) -> T:
        if not self.breaker.allow():
            raise StoreUnavailable("the Responses store (Redis) is not answering; its circuit breaker is open",
                                   self._retry_after)
        try:
            async with asyncio.timeout(self._timeout):
                result = await op()
        except asyncio.CancelledError:
            self.breaker.failure()  # a half-open probe must end
            raise
        except Exception as exc:
            self.breaker.failure()
            raise StoreUnavailable(f"the Responses store (Redis) failed: {type(exc).__name__}: {exc}",
                                   self._retry_after) from exc
        self.breaker.success()
        return result

    async def put(self, owner: str, response: dict[str, Any], history: list[dict[str, Any]]) -> bool:
        value = json.dumps({"response": response, "history": history}, separators=(",", ":")).encode()
        if not self.enabled or len(value) > self._config.max_bytes:
            return False
        entry, ids, prefix = self._names(owner, response["id"])
        await self._call(lambda: self._put(keys=[entry, ids],
                                           args=[value, self._ttl, self._config.max_entries, response["id"], prefix]))
        return True

    async def get(self, owner: str, response_id: str) -> StoredResponse | None:
        entry, _, _ = self._names(owner, response_id)

        async def read() -> list[Any]:
            async with self._client.pipeline(transaction=False) as pipe:
                pipe.get(entry)
                pipe.pttl(entry)
                return list(await pipe.execute())

        value, pttl = await self._call(read)
        if value is None:
            return None
        data = json.loads(value)
        expires_at = self._clock.monotonic() + max(int(pttl), 0) / 1000.0
        return StoredResponse(owner, data["response"], data["history"], expires_at, len(value))

    async def delete(self, owner: str, response_id: str) -> bool:
        entry, ids, _ = self._names(owner, response_id)

        async def drop() -> list[Any]:
            async with self._client.pipeline(transaction=True) as pipe:
                pipe.delete(entry)
                pipe.lrem(ids, 0, response_id)
                return list(await pipe.execute())

        deleted, _ = await self._call(drop)
        return bool(deleted)

    async def aclose(self) -> None:
        await self._client.aclose()
