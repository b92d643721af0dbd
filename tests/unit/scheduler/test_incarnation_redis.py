"""The incarnation record in a Redis (services/scheduler/incarnation_redis.py),
against a real redis-server: schedulers on several hosts share it, an id's
entry never goes down (63-bit incarnations compared exactly), a clock far
ahead is not recorded, a dead Redis refuses nobody; and the config picks
the store."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from _redis_server import RedisServer

from services.common.config import ConfigError, MeshConfig, validate_config
from services.scheduler.incarnation_redis import RedisIncarnations
from services.scheduler.incarnation_store import FUTURE_TOLERANCE_SECONDS, FileIncarnations, Newest
from services.scheduler.server import incarnation_store_for

NOW = int(time.time() * 1000) << 22
FUTURE = int((time.time() + 2 * FUTURE_TOLERANCE_SECONDS) * 1000) << 22


@pytest.fixture
async def redis_url(tmp_path: Path) -> AsyncIterator[str]:
    with RedisServer.start(tmp_path / "redis") as server:
        yield server.url


async def test_every_scheduler_on_the_redis_shares_the_greatest_per_id(redis_url: str) -> None:
    one, two = RedisIncarnations(redis_url), RedisIncarnations(redis_url)
    try:
        assert await one.remember("e", NOW + 5, "new:1") == Newest(NOW + 5, "new:1")
        assert await two.remember("e", NOW, "old:1") == Newest(NOW + 5, "new:1")     # never lowered
        assert await two.remember("e", NOW + 5, "new:1") == Newest(NOW + 5, "new:1")  # the current one
        # One apart: equal as doubles (Redis' Lua numbers), told apart by the exact comparison.
        assert float(NOW + 1) == float(NOW)
        assert await two.remember("f", NOW + 1, "f:1") == Newest(NOW + 1, "f:1")
        assert await one.remember("f", NOW, "f:0") == Newest(NOW + 1, "f:1")
        assert await one.remember("g", FUTURE, "wrong:1") == Newest(FUTURE, "wrong:1")   # taken, not recorded
        assert await one.remember("g", NOW, "g:1") == Newest(NOW, "g:1")
    finally:
        await one.aclose()
        await two.aclose()


async def test_a_redis_that_does_not_answer_refuses_nobody(tmp_path: Path) -> None:
    with RedisServer.start(tmp_path / "redis") as server:
        url = server.url
        server.kill()
    gone = RedisIncarnations(url)
    try:
        assert await gone.remember("e", NOW, "old:1") == Newest(NOW, "old:1")
    finally:
        await gone.aclose()


def test_the_config_picks_the_store(tmp_path: Path) -> None:
    config = MeshConfig(run_dir=str(tmp_path))
    assert isinstance(incarnation_store_for(config), FileIncarnations)
    config.scheduler.incarnations_redis_url = "redis://127.0.0.1:1/0"
    assert isinstance(incarnation_store_for(config), RedisIncarnations)
    config.scheduler.incarnations_redis_url = "127.0.0.1:6379"
    with pytest.raises(ConfigError, match=r"scheduler\.incarnations_redis_url"):
        validate_config(config)
