"""The Redis store against a real redis-server (started on a free loopback
port, killed by PID): entries round-trip with a TTL, and a dead or silent
Redis is a miss and an error count -- never an exception -- with the
circuit breaker sparing later requests its timeout."""

from __future__ import annotations

import asyncio
import dataclasses
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _redis_server import RedisServer
from prometheus_client import CollectorRegistry
from redis.asyncio import Redis

from services.common.clock import FakeClock
from services.common.config.response_cache import ResponseCacheConfig
from services.common.openai_api.requests import GenerationInput, SamplingOptions
from services.gateway.events import Finished, FinishReason, TextDelta, Usage
from services.gateway.jobs import Job
from services.gateway.keys import Principal
from services.gateway.response_cache.cache import ResponseCache
from services.gateway.response_cache.metrics import CacheMetrics
from services.gateway.response_cache.policy import CacheStatus
from services.gateway.response_cache.record import encode_entry
from services.gateway.response_cache.redis_store import RedisStore, StoreUnavailable

PRINCIPAL = Principal("k", "acme", 0, frozenset(), 0.0, 0.0, 0.0, response_cache="on")
JOB = Job(request_id="r", route="chat", model="m", tenant="acme", priority=0, prompt_ids=[1, 2, 3],
          prefix_hashes=[], sampling=SamplingOptions(temperature=0.0), max_tokens=8, max_generation_seconds=60.0,
          arrival_unix=0.0, arrival_monotonic=0.0, hash_block_tokens=16)
REQUEST = GenerationInput(route="chat", model="m", sampling=SamplingOptions(temperature=0.0))
ENTRY = encode_entry([TextDelta("hi", [7], index=1), Finished(FinishReason.STOP, Usage(3, 1, 0))])


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    with RedisServer.start(tmp_path / "redis") as server:
        yield server


def _cache(url: str, clock: FakeClock, **settings: Any) -> tuple[ResponseCache, RedisStore, CacheMetrics]:
    # Generous timeouts unless a test sets its own: a live Redis on a loaded
    # machine is still a live Redis (the 0.1 s defaults are the request path's).
    config = dataclasses.replace(ResponseCacheConfig(store="redis", redis_url=url, ttl_seconds=60,
                                                     op_timeout_seconds=5.0, connect_timeout_seconds=5.0),
                                 **settings)
    metrics = CacheMetrics(CollectorRegistry(), "redis")
    store = RedisStore(config, clock, metrics)
    return ResponseCache(config, store, metrics, {"m": (Path("/nonexistent"), "rev-1")}, clock), store, metrics


def _value(metric: object) -> float:
    return metric._value.get()  # type: ignore[attr-defined]  # prometheus_client's private value holder


async def _lookup(cache: ResponseCache) -> CacheStatus:
    return (await cache.lookup(JOB, REQUEST, PRINCIPAL, {})).status


async def test_entries_round_trip_with_a_ttl_and_bytes_are_counted(redis_server: RedisServer) -> None:
    clock = FakeClock()
    cache, store, metrics = _cache(redis_server.url, clock)
    try:
        assert await _lookup(cache) == CacheStatus.MISS
        ticket = await cache.lookup(JOB, REQUEST, PRINCIPAL, {})
        await cache._put(ticket.key, ENTRY)
        assert await _lookup(cache) == CacheStatus.HIT
        assert (_value(metrics.hits), _value(metrics.misses), _value(metrics.stores)) == (1, 2, 1)
        assert _value(metrics.bytes) == len(ENTRY) and _value(metrics.errors) == 0
        client = Redis.from_url(redis_server.url)
        try:
            ttl = await client.ttl(f"kvmesh:rc:{ticket.key}")
        finally:
            await client.aclose()
        assert 0 < ttl <= 60
        clock.advance(61)                               # what this gateway wrote has expired
        await store.put("other", b"x")
        assert _value(metrics.bytes) == 1
    finally:
        await cache.aclose()


async def test_a_killed_redis_is_a_miss_and_an_error_and_the_breaker_opens(redis_server: RedisServer) -> None:
    clock = FakeClock()
    cache, store, metrics = _cache(redis_server.url, clock, breaker_failures=3, breaker_reset_seconds=5.0)
    try:
        assert await _lookup(cache) == CacheStatus.MISS
        redis_server.kill()
        for _ in range(3):
            assert await _lookup(cache) == CacheStatus.MISS     # no exception reaches the request
        assert _value(metrics.errors) == 3 and store.breaker.open
        # Open: Redis is not asked at all (no connect, no timeout), still a miss.
        with pytest.raises(StoreUnavailable):
            await store.get("x")
        cache._store_later("k", ENTRY)                            # a store fails quietly too
        await asyncio.gather(*cache._pending)
        assert _value(metrics.errors) == 4 and _value(metrics.stores) == 0
        # Back after the reset: one probe, and it succeeds.
        restarted = RedisServer.start(redis_server.log.parent / "again")
        try:
            cache2, store2, _ = _cache(restarted.url, clock)
            store2.breaker = store.breaker
            clock.advance(5.1)
            assert await _lookup(cache2) == CacheStatus.MISS and not store2.breaker.open
            await cache2.aclose()
        finally:
            restarted.stop()
    finally:
        await cache.aclose()


async def test_a_silent_redis_costs_at_most_its_timeout() -> None:
    """A peer that accepts and never answers (a hung Redis): each call ends at
    op_timeout_seconds, then the breaker spares the rest."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    clock = FakeClock()
    cache, store, metrics = _cache(f"redis://127.0.0.1:{listener.getsockname()[1]}/0", clock,
                                   op_timeout_seconds=0.1, connect_timeout_seconds=0.1, breaker_failures=2)
    try:
        began = time.monotonic()
        statuses = [await _lookup(cache) for _ in range(10)]
        elapsed = time.monotonic() - began
        assert statuses == [CacheStatus.MISS] * 10
        assert store.breaker.open and _value(metrics.errors) == 10
        # Two calls waited for their timeout; eight were skipped: far below 10 x 0.1 s + slack.
        assert elapsed < 0.9, elapsed
    finally:
        await cache.aclose()
        listener.close()
