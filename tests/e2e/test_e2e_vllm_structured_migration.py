"""A structured stream whose vLLM engine is SIGKILLed mid-way still ends in
valid JSON of its schema: the gateway migrates it (prompt + the tokens
already sent) and the new engine continues the grammar from those tokens
(services/engine/vllm_backend/resume_grammar.py) instead of starting it
afresh in the middle of an object. Greedy streams also equal an
uninterrupted run, token for token.

ONE test, on the SmolLM2-135M-Instruct pair (two vLLM-CPU engines) the run
shares with the agent-API tests (tests/e2e/conftest.py; it runs right after
them). The killed engine stays down; a later user of the pair restarts it.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import aiohttp
import pytest
from _streams import gateway_counter, scheduler_state, wait_until
from _vllm_mesh import SharedVllmMesh
from jsonschema import Draft202012Validator

from services.bench.sse import SseEvents
from services.launcher.mesh import Mesh

pytestmark = [pytest.mark.vllm, pytest.mark.e2e, pytest.mark.timeout(900)]

MODEL = "SmolLM2-135M-Instruct"
STREAMS = 4
ITEM = {"type": "object", "additionalProperties": False, "required": ["word", "ok"],
        "properties": {"word": {"type": "string", "maxLength": 12}, "ok": {"type": "boolean"}}}
# 20 objects: hundreds of tokens (SmolLM2 indents generously), several seconds of decode,
# so every stream is mid-object when the engine dies.
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["items"],
          "properties": {"items": {"type": "array", "items": ITEM, "minItems": 20, "maxItems": 20}}}


@pytest.fixture(scope="module")
def two_vllm(shared_smol_pair: SharedVllmMesh, tmp_path_factory: pytest.TempPathFactory) -> Mesh:
    """Two SmolLM2 engines, the hang floor 180 s (tests/e2e/conftest.py)."""
    return shared_smol_pair.get(tmp_path_factory).mesh


class Seen:
    def __init__(self) -> None:
        self.status, self.text, self.chunks = 0, "", 0
        self.finish: str | None = None
        self.error: Any = None
        self.done = False


async def _stream(session: aiohttp.ClientSession, mesh: Mesh, i: int, seen: Seen) -> Seen:
    body = {"model": MODEL, "stream": True, "max_tokens": 4000, "temperature": 0,
            "messages": [{"role": "user", "content": f"List 20 words about topic {i} as JSON."}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "words", "schema": SCHEMA}}}
    async with asyncio.timeout(420), session.post(
            f"{mesh.endpoints.public_http}/v1/chat/completions", json=body,
            headers={"Authorization": f"Bearer {mesh.api_key}"}) as resp:
        seen.status = resp.status
        if resp.status != 200:
            seen.error = await resp.text()
            return seen
        async for event in SseEvents(resp.content):
            if "error" in event:
                seen.error = event["error"]
            for choice in event.get("choices", []):
                seen.text += choice.get("delta", {}).get("content") or ""
                seen.finish = choice.get("finish_reason") or seen.finish
            seen.chunks += 1
        seen.done = True
    return seen


def _valid(text: str) -> bool:
    try:
        return not list(Draft202012Validator(SCHEMA).iter_errors(json.loads(text)))
    except ValueError:
        return False


async def test_vllm_engine_sigkill_mid_structured_stream_ends_in_valid_json(two_vllm: Mesh) -> None:
    mesh = two_vllm
    async with aiohttp.ClientSession() as session:
        baseline = await asyncio.gather(*(_stream(session, mesh, i, Seen()) for i in range(STREAMS)))
        assert all(b.finish == "stop" and _valid(b.text) for b in baseline), [b.text[-80:] for b in baseline]
        migrations = gateway_counter(mesh, "kvmesh_gateway_migrations_total")

        def both_serving() -> bool:  # a loaded machine may have restarted one (liveness bound)
            state = scheduler_state(mesh)
            return state is not None and len(state.engines) == 2 and all(e.serving and e.fresh and not e.draining
                                                                          for e in state.engines)
        await wait_until(both_serving, 300, "both engines to serve")

        seen = [Seen() for _ in range(STREAMS)]
        tasks = [asyncio.create_task(_stream(session, mesh, i, s)) for i, s in enumerate(seen)]

        # Prefix affinity may place every stream on one engine: then they all migrate.
        await wait_until(lambda: all(s.chunks >= 40 for s in seen), 240, "every stream to be well into its JSON")
        await wait_until(both_serving, 300, "both engines to serve before the kill")
        state = scheduler_state(mesh)
        assert state is not None
        victim = max(state.engines, key=lambda e: e.leases)
        assert victim.leases > 0 and not all(s.done for s in seen)
        killed = time.monotonic()
        mesh.kill(victim.engine_id)
        await asyncio.gather(*tasks)
        elapsed = time.monotonic() - killed

    for i, s in enumerate(seen):
        assert s.status == 200 and s.error is None and s.finish == "stop", (i, s.status, s.error, s.finish)
        assert _valid(s.text), f"stream {i} is not valid JSON of the schema: ...{s.text[-120:]!r}"
        assert s.text == baseline[i].text, f"stream {i}: the migrated greedy text differs from the uninterrupted run"
    moved = gateway_counter(mesh, "kvmesh_gateway_migrations_total") - migrations
    assert moved >= 1
    print(f"vLLM SIGKILL mid structured stream: {STREAMS} streams valid and identical, {moved:.0f} migrated, "
          f"{elapsed:.1f}s from kill to last token")
