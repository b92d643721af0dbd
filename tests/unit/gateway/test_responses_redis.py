"""The Responses store every gateway sees (services/gateway/responses_redis.py)
against a real redis-server: two gateways' stores share entries, scoped to
the API key, with a TTL, each key's list bounded; a dead Redis is a clear
StoreUnavailable (503 at the API), with the breaker sparing later calls its
timeout; and the config picks the store."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from _redis_server import RedisServer
from redis.asyncio import Redis

from services.common.clock import FakeClock
from services.common.config import ConfigError, MeshConfig, validate_config
from services.common.config.response_cache import ResponseCacheConfig
from services.common.config.responses import ResponsesConfig
from services.gateway.responses_redis import RedisResponses
from services.gateway.responses_store import EmbeddedResponses, StoreUnavailable, build_responses_store

USER = [{"type": "message", "role": "user", "content": "q"}]


def response(response_id: str, text: str = "hi") -> dict[str, object]:
    return {"id": response_id, "object": "response", "output": [
        {"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
         "content": [{"type": "output_text", "text": text, "annotations": []}]}]}


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    with RedisServer.start(tmp_path / "redis") as server:
        yield server


@pytest.fixture
async def client(redis_server: RedisServer) -> AsyncIterator[Redis]:
    """A plain client, to look at what the store wrote."""
    plain = Redis.from_url(redis_server.url)
    yield plain
    await plain.aclose()


def _store(url: str, clock: FakeClock | None = None, **settings: Any) -> RedisResponses:
    # A live Redis answers within its timeouts on a loaded machine too (the
    # 0.1 s defaults are for the request path; these tests assert results).
    redis = ResponseCacheConfig(store="redis", redis_url=url, op_timeout_seconds=5.0, connect_timeout_seconds=5.0)
    return RedisResponses(ResponsesConfig(store="redis", **settings), redis, clock or FakeClock())


async def test_every_gateway_sees_an_entry_and_only_its_key(redis_server: RedisServer) -> None:
    one, two = _store(redis_server.url), _store(redis_server.url)   # two gateways
    try:
        assert await one.put("key-a", response("resp_1"), USER)
        entry = await two.get("key-a", "resp_1")
        assert entry is not None and entry.owner == "key-a"
        assert entry.conversation == [*USER, {"type": "message", "role": "assistant", "content": "hi"}]
        assert await two.get("key-b", "resp_1") is None          # another key: not found
        assert not await two.delete("key-b", "resp_1")
        assert await two.delete("key-a", "resp_1")
        assert await one.get("key-a", "resp_1") is None
        assert not await one.delete("key-a", "resp_1")
    finally:
        await one.aclose()
        await two.aclose()


async def test_entries_carry_the_ttl_and_expire(redis_server: RedisServer, client: Redis) -> None:
    store = _store(redis_server.url, ttl_seconds=1)
    try:
        await store.put("key-a", response("resp_1"), USER)
        assert 0 < await client.pttl("kvmesh:resp:key-a:resp_1") <= 1000
        assert 0 < await client.pttl("kvmesh:resp:key-a:ids") <= 1000
        deadline = time.monotonic() + 5
        while await store.get("key-a", "resp_1") is not None:
            assert time.monotonic() < deadline, "the entry outlived its TTL"
            await asyncio.sleep(0.05)
    finally:
        await store.aclose()


async def test_each_keys_entries_are_bounded_oldest_first(redis_server: RedisServer, client: Redis) -> None:
    store = _store(redis_server.url, max_entries=3)
    try:
        for i in range(5):
            assert await store.put("key-a", response(f"resp_{i}"), USER)
        await store.put("key-b", response("resp_b"), USER)
        assert [await store.get("key-a", f"resp_{i}") is not None for i in range(5)] == [False, False, True, True,
                                                                                          True]
        assert await client.lrange("kvmesh:resp:key-a:ids", 0, -1) == [b"resp_2", b"resp_3", b"resp_4"]
        assert await store.get("key-b", "resp_b") is not None     # another key's bound is its own
        assert len(await client.keys("kvmesh:resp:key-a:resp_*")) == 3
        # Storing the same id again does not count it twice.
        await store.put("key-a", response("resp_4", "again"), USER)
        assert await client.llen("kvmesh:resp:key-a:ids") == 3
        entry = await store.get("key-a", "resp_4")
        assert entry is not None and entry.response["output"][0]["content"][0]["text"] == "again"
    finally:
        await store.aclose()


async def test_an_entry_larger_than_max_bytes_is_not_stored(redis_server: RedisServer) -> None:
    store = _store(redis_server.url, max_bytes=100)
    try:
        assert not await store.put("key-a", response("resp_1", "x" * 200), USER)
        assert await store.get("key-a", "resp_1") is None
        assert not _store(redis_server.url, max_entries=0).enabled
    finally:
        await store.aclose()


async def test_a_dead_redis_is_unavailable_and_the_breaker_opens(redis_server: RedisServer) -> None:
    clock = FakeClock()
    store = _store(redis_server.url, clock)
    try:
        await store.put("key-a", response("resp_1"), USER)
        redis_server.kill()
        for _ in range(3):                                     # breaker_failures, default 3
            with pytest.raises(StoreUnavailable) as failed:
                await store.get("key-a", "resp_1")
            assert failed.value.retry_after == 5.0
        assert store.breaker.open
        started = time.monotonic()
        with pytest.raises(StoreUnavailable, match="circuit breaker is open"):
            await store.put("key-a", response("resp_2"), USER)
        with pytest.raises(StoreUnavailable, match="circuit breaker is open"):
            await store.delete("key-a", "resp_1")
        assert time.monotonic() - started < 0.05               # not asked: no timeout paid
    finally:
        await store.aclose()


def test_the_config_picks_the_store() -> None:
    config = MeshConfig()
    assert isinstance(build_responses_store(config, FakeClock()), EmbeddedResponses)
    config.responses.store = "redis"
    with pytest.raises(ConfigError, match=r"responses\.store: redis needs gateway\.response_cache\.redis_url"):
        validate_config(config)
    config.gateway.response_cache.redis_url = "redis://127.0.0.1:6379/0"
    validate_config(config)
    assert isinstance(build_responses_store(config, FakeClock()), RedisResponses)
    config.responses.store = "memcached"
    with pytest.raises(ConfigError, match=r"responses\.store: must be one of embedded, redis"):
        validate_config(config)
