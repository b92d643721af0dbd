"""The incarnation record in a Redis (incarnation_store.py says why there is
a record): for schedulers on several hosts, which share no file.

One hash, `KEY`: engine id -> "<incarnation, 20 digits> <address>". A Lua
script reads, compares and writes in one step, so concurrent hellos at
several schedulers cannot lower an id's entry; the incarnation is compared
as a fixed-width decimal string because Redis' Lua numbers are doubles
(53 bits) and incarnations take 63.

Failures: every call is bounded (connect and per call, TIMEOUT_SECONDS)
and never retried; a Redis that does not answer refuses nobody (the hello
goes on with the scheduler's in-memory fence, logged).
"""

from __future__ import annotations

import logging
import time

from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from .incarnation_store import FUTURE_TOLERANCE_SECONDS, TIMEOUT_SECONDS, Newest, incarnation_unix_seconds

__all__ = ["KEY", "RedisIncarnations"]

log = logging.getLogger(__name__)

KEY = "kvmesh:scheduler:incarnations"
_DIGITS = 20   # 2**63 has 19 digits

# KEYS[1] the hash; ARGV: id, padded incarnation, address, "1" to record it.
_REMEMBER = """
local known = redis.call('HGET', KEYS[1], ARGV[1])
if known and string.sub(known, 1, 20) >= ARGV[2] then return known end
local entry = ARGV[2] .. ' ' .. ARGV[3]
if ARGV[4] == '1' then redis.call('HSET', KEYS[1], ARGV[1], entry) end
return entry
"""


class RedisIncarnations:
    def __init__(self, url: str) -> None:
        self.url = url
        self._redis = Redis.from_url(url, socket_connect_timeout=TIMEOUT_SECONDS, socket_timeout=TIMEOUT_SECONDS,
                                     retry=Retry(NoBackoff(), 0), retry_on_timeout=False, health_check_interval=0)
        self._script = self._redis.register_script(_REMEMBER)

    async def remember(self, engine_id: str, incarnation: int, address: str) -> Newest:
        incoming = Newest(incarnation, address)
        if incarnation <= 0:
            return incoming
        recordable = incarnation_unix_seconds(incarnation) <= time.time() + FUTURE_TOLERANCE_SECONDS
        try:
            entry = await self._script(keys=[KEY], args=[engine_id, f"{incarnation:0{_DIGITS}d}", address,
                                                         "1" if recordable else "0"])
            text = entry.decode() if isinstance(entry, bytes) else str(entry)
            padded, _, known_address = text.partition(" ")
            return Newest(int(padded), known_address)
        except (RedisError, OSError, ValueError) as exc:
            log.warning("engine incarnations at %s unavailable (%s: %s); engine %s is checked against this "
                        "scheduler's memory only", self.url, type(exc).__name__, exc, engine_id)
            return incoming

    async def aclose(self) -> None:
        await self._redis.aclose()
