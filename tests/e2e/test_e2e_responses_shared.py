"""The Responses store every gateway sees, on a real sim mesh: two gateways
sharing one real redis-server (`responses.store: redis`), Envoy in front
balancing without stickiness. A 10-turn conversation through Envoy, each
turn continuing the last with `previous_response_id`, succeeds on every turn
(issue 29: with each gateway's own store 4 of 10 turns got 404) -- and still
does when one gateway is SIGKILLed between turns.

One module-scoped mesh (its Redis URL is in the gateways' config, so it
cannot be the shared e2e_mesh)."""

from __future__ import annotations

import asyncio
import urllib.request
from collections.abc import Iterator

import openai
import pytest
from _redis_mesh import redis_mesh
from _redis_server import RedisServer
from openai.types.responses import ResponseCompletedEvent, ResponseIncompleteEvent

from services.common.config import MeshConfig
from services.launcher.mesh import Mesh

pytestmark = pytest.mark.e2e

MODEL = "tiny-llama"
TURNS = 10
KILL_AFTER = 5


@pytest.fixture(scope="module")
def shared_mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    """The mesh on its own redis-server, the Responses store there."""
    def shared_store(config: MeshConfig) -> None:
        config.responses.store = "redis"   # on the response cache's Redis; the cache itself off

    with RedisServer.start(tmp_path_factory.mktemp("redis")) as redis, \
            redis_mesh(redis.url, tmp_path_factory.mktemp("responses-mesh"), shared_store, cache=False) as mesh:
        yield mesh


def _requests(mesh: Mesh, replica: int) -> float:
    """All requests gateway `replica` finished, any route or status."""
    port = mesh.config.gateway.metrics_port + replica
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        lines = resp.read().decode().splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith("kvmesh_gateway_requests_total{"))


def _turn(sdk: openai.OpenAI, turn: int, previous: str | None) -> tuple[str, int]:
    """(response id, input tokens) of one turn; turn 3 and 8 streamed."""
    question = f"Turn {turn}: and what happened next?"
    if turn in (3, 8):
        events = list(sdk.responses.create(model=MODEL, input=question, max_output_tokens=8, store=True,
                                           previous_response_id=previous, stream=True))
        final = events[-1]
        # max_output_tokens ends it: incomplete, stored all the same.
        assert isinstance(final, ResponseCompletedEvent | ResponseIncompleteEvent), final
        assert final.response.usage is not None
        return final.response.id, final.response.usage.input_tokens
    out = sdk.responses.create(model=MODEL, input=question, max_output_tokens=8, store=True,
                               previous_response_id=previous)
    assert out.usage is not None
    return out.id, out.usage.input_tokens


async def test_a_conversation_survives_any_gateway(shared_mesh: Mesh) -> None:
    mesh = shared_mesh
    sdk = openai.OpenAI(base_url=f"{mesh.endpoints.public_http}/v1", api_key=mesh.api_key,
                        timeout=60.0, max_retries=0)
    previous: str | None = None
    inputs: list[int] = []
    served = []
    for turn in range(TURNS):
        if turn == KILL_AFTER:
            served = [_requests(mesh, r) for r in (0, 1)]
            mesh.kill("gateway-0")
        try:
            previous, input_tokens = await asyncio.to_thread(_turn, sdk, turn, previous)
        except openai.APIStatusError as exc:
            raise AssertionError(f"turn {turn} failed: {exc.status_code} {exc.message}") from exc
        inputs.append(input_tokens)
    # Every turn carried the whole conversation before it.
    assert inputs == sorted(inputs) and len(set(inputs)) == TURNS, inputs
    assert all(s > 0 for s in served), f"Envoy did not use both gateways before the kill: {served}"
    assert previous is not None and sdk.responses.retrieve(previous).id == previous
