"""The Responses API over the shared store (responses.store: redis): two
gateways on one real redis-server continue each other's responses, streamed
or not; with Redis gone a continuation is a 503 `responses_store_unavailable`
(with Retry-After), not a 404, and an answer is still returned."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import aiohttp
import openai
import pytest
from _redis_server import RedisServer
from conftest import KEY_FULL, KEY_P1, MODEL, Mesh, open_mesh

from services.common.config import MeshConfig

HEADERS = {"Authorization": f"Bearer {KEY_FULL}"}


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    with RedisServer.start(tmp_path / "redis") as server:
        yield server


def _shared(url: str) -> Callable[[MeshConfig], None]:
    def tune(config: MeshConfig) -> None:
        config.responses.store = "redis"
        config.gateway.response_cache.redis_url = url
    return tune


def client(mesh: Mesh, key: str = KEY_FULL) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{mesh.http}/v1", api_key=key, max_retries=0, timeout=20)


async def test_two_gateways_continue_each_others_responses(model_dir: Path, redis_server: RedisServer) -> None:
    async with open_mesh(model_dir, _shared(redis_server.url)) as one, \
            open_mesh(model_dir, _shared(redis_server.url)) as two:
        gateways = [one, two]
        previous = None
        for turn in range(6):
            async with client(gateways[turn % 2]) as c:
                if turn % 3 == 2:   # a streamed turn: stored before response.completed is sent
                    async with await c.responses.create(model=MODEL, input=f"turn {turn}", store=True,
                                                        previous_response_id=previous, stream=True) as events:
                        completed = [e async for e in events if e.type == "response.completed"]
                    previous = completed[0].response.id
                else:
                    out = await c.responses.create(model=MODEL, input=f"turn {turn}", store=True,
                                                   previous_response_id=previous)
                    previous = out.id
        assert previous is not None
        async with client(one) as c:
            got = await c.responses.retrieve(previous)
            assert got.id == previous
        async with client(two, KEY_P1) as c:                    # another key: not found
            with pytest.raises(openai.NotFoundError):
                await c.responses.retrieve(previous)
        async with client(two) as c:
            await c.responses.delete(previous)
            with pytest.raises(openai.NotFoundError):
                await c.responses.retrieve(previous)


async def test_without_redis_a_continuation_is_a_503_not_a_404(model_dir: Path, redis_server: RedisServer) -> None:
    async with open_mesh(model_dir, _shared(redis_server.url)) as mesh:
        async with client(mesh) as c:
            first = await c.responses.create(model=MODEL, input="hello", store=True)
        redis_server.kill()
        async with aiohttp.ClientSession() as session:
            body = {"model": MODEL, "input": "again", "previous_response_id": first.id}
            async with session.post(f"{mesh.http}/v1/responses", json=body, headers=HEADERS) as r:
                assert r.status == 503, await r.text()
                error = (await r.json())["error"]
                assert error["code"] == "responses_store_unavailable" and r.headers["Retry-After"]
            async with session.get(f"{mesh.http}/v1/responses/{first.id}", headers=HEADERS) as r:
                assert r.status == 503
        async with client(mesh) as c:                           # not stored, but answered
            out = await c.responses.create(model=MODEL, input="new", store=True)
            assert out.status == "completed"
