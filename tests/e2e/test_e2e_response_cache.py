"""The response cache on a real sim mesh: two gateways sharing one real
redis-server, Envoy in front. A second identical greedy request is answered
without an engine (the engines' own counters do not move) with the same
text, streamed as SSE through Envoy, and also by the OTHER gateway; another
tenant's identical request is generated, not read from the first tenant's
entry; with Redis SIGKILLed mid-run every request still succeeds (served by
the engines) and the gateways count the cache's errors.

One module-scoped mesh (its Redis URL is in the gateways' config, so it
cannot be the shared e2e_mesh)."""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
from _redis_mesh import redis_mesh
from _redis_server import RedisServer
from _streams import engine_counters, gateway_counter, scheduler_state, wait_until
from redis.asyncio import Redis

from services.common.config import ApiKeyConfig, MeshConfig
from services.common.model_revision import model_revision
from services.launcher.mesh import Mesh

pytestmark = pytest.mark.e2e

MODEL = "tiny-llama"
KEY_A = "sk-e2e-cache-alpha"    # tenant alpha, cache on
KEY_B = "sk-e2e-cache-beta"     # tenant beta, cache on (its own scope)
# Every engine-side count a generation moves: none may move on a hit.
ENGINE_COUNTERS = ("vllm:request_success_total", "vllm:prompt_tokens_total", "vllm:generation_tokens_total")


def _key(raw: str, tenant: str) -> ApiKeyConfig:
    return ApiKeyConfig(sha256=hashlib.sha256(raw.encode()).hexdigest(), tenant=tenant, response_cache="on")


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    with RedisServer.start(tmp_path_factory.mktemp("redis")) as server:
        yield server


@pytest.fixture(scope="module")
def cache_mesh(redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    def keys(config: MeshConfig) -> None:
        config.gateway.api_keys += [_key(KEY_A, "alpha"), _key(KEY_B, "beta")]

    with redis_mesh(redis_server.url, tmp_path_factory.mktemp("cache-mesh"), keys) as mesh:
        yield mesh


def _engine_totals(mesh: Mesh) -> tuple[float, ...]:
    return tuple(sum(engine_counters(mesh, name)) for name in ENGINE_COUNTERS)


async def _chat(session: aiohttp.ClientSession, base: str, key: str, question: str) -> tuple[str, str, int]:
    """(X-Kvmesh-Cache, the streamed text, SSE data frames) of one greedy streamed chat."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": question}], "temperature": 0,
            "max_tokens": 24, "stream": True}
    async with session.post(f"{base}/v1/chat/completions", json=body,
                            headers={"Authorization": f"Bearer {key}"}) as resp:
        raw = await resp.text()
        assert resp.status == 200, raw[:500]
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        status = resp.headers.get("X-Kvmesh-Cache", "")
    frames = [line[6:] for line in raw.splitlines() if line.startswith("data: ")]
    assert frames[-1] == "[DONE]", raw[-300:]
    chunks = [json.loads(f) for f in frames[:-1]]
    assert not any("error" in c for c in chunks), raw[-500:]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices"))
    return status, text, len(frames)


async def _stored_entries(url: str) -> int:
    client = Redis.from_url(url)
    try:
        return len(await client.keys("kvmesh:rc:*"))
    finally:
        await client.aclose()


async def _settled(mesh: Mesh, success_at_least: float) -> tuple[float, ...]:
    """The engines' totals once they count `success_at_least` finished requests."""
    await wait_until(lambda: _engine_totals(mesh)[0] >= success_at_least, 30, "the engines' request counts")
    return _engine_totals(mesh)


async def test_a_hit_needs_no_engine_on_either_gateway_and_through_envoy(
        cache_mesh: Mesh, redis_server: RedisServer) -> None:
    mesh = cache_mesh
    # Each engine reports the revision it loaded (EngineHello -> GetState): the
    # fingerprint of the same files the gateways would compute themselves.
    state = scheduler_state(mesh)
    assert state is not None
    expected = model_revision(Path(mesh.config.model(MODEL).path))
    assert [e.model_revision for e in state.engines] == [expected] * 2
    gw0, gw1 = mesh.endpoints.gateway_http
    async with aiohttp.ClientSession() as session:
        status, text, _ = await _chat(session, gw0, KEY_A, "What is a response cache?")
        assert status == "miss" and text
        for _ in range(100):   # the entry is written in the background, after the answer
            if await _stored_entries(redis_server.url):
                break
            await asyncio.sleep(0.1)
        assert await _stored_entries(redis_server.url) == 1
        before = await _settled(mesh, 1)
        # The other gateway reads gateway 0's entry from the shared Redis.
        status, again, frames = await _chat(session, gw1, KEY_A, "What is a response cache?")
        assert (status, again) == ("hit", text) and frames > 3
        # Through Envoy (either gateway): a normal SSE stream, the same text.
        status, via_edge, _ = await _chat(session, mesh.endpoints.public_http, KEY_A, "What is a response cache?")
        assert (status, via_edge) == ("hit", text)
        await asyncio.sleep(0.5)   # anything an engine did would be counted by now
        assert _engine_totals(mesh) == before
        assert gateway_counter(mesh, "kvmesh_gateway_response_cache_hits_total", 'store="redis"', replica=1) >= 1

        # Another tenant's identical request: generated by an engine, not read from alpha's entry.
        status, other, _ = await _chat(session, mesh.endpoints.public_http, KEY_B, "What is a response cache?")
        assert status == "miss" and other == text     # greedy: the same answer, but from an engine
        await _settled(mesh, before[0] + 1)


async def test_redis_killed_mid_run_every_request_still_succeeds(
        cache_mesh: Mesh, redis_server: RedisServer) -> None:
    mesh = cache_mesh

    def errors() -> float:
        return sum(gateway_counter(mesh, "kvmesh_gateway_response_cache_errors_total", 'store="redis"', replica=r)
                   for r in range(2))

    async with aiohttp.ClientSession() as session:
        status, text, _ = await _chat(session, mesh.endpoints.public_http, KEY_A, "Before the crash")
        assert status in ("miss", "hit") and text
        errors_before = errors()
        redis_server.kill()
        done = (await asyncio.to_thread(_engine_totals, mesh))[0]
        for i in range(6):
            status, answer, _ = await _chat(session, mesh.endpoints.public_http, KEY_A, f"After the crash {i % 2}")
            assert status == "miss" and answer, (i, status)   # a failed lookup is a miss, served by an engine
        await _settled(mesh, done + 6)
    assert errors() > errors_before
