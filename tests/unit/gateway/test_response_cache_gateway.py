"""The response cache in a gateway wired to in-process fakes: a hit is
replayed -- SSE, JSON and gRPC -- without reaching the scheduler or the
engine; the key's mode and the request's headers decide; tenants do not
share entries unless their keys do."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import grpc
import pytest
from conftest import MODEL, Mesh, expected_answer, open_mesh, sha

from services.common.config import ApiKeyConfig
from services.common.config.response_cache import ResponseCacheConfig
from services.common.proto.kvmesh.v1 import common_pb2, inference_pb2, inference_pb2_grpc

KEY_ON = "sk-cache-on"          # tenant acme, response_cache on
KEY_ON_2 = "sk-cache-on-2"      # tenant beta, on
KEY_ASK = "sk-cache-ask"        # tenant acme, only when the request asks
KEY_SHARE_1 = "sk-share-1"      # tenant gamma, shared scope
KEY_SHARE_2 = "sk-share-2"      # tenant delta, shared scope
KEY_PLAIN = "sk-plain"          # tenant acme, cache off (the default)

CHAT = [{"role": "user", "content": "hello world"}]


@pytest.fixture
async def mesh(model_dir: Path) -> AsyncIterator[Mesh]:
    keys = [
        ApiKeyConfig(sha256=sha(KEY_ON), tenant="acme", response_cache="on"),
        ApiKeyConfig(sha256=sha(KEY_ON_2), tenant="beta", response_cache="on"),
        ApiKeyConfig(sha256=sha(KEY_ASK), tenant="acme", response_cache="request"),
        ApiKeyConfig(sha256=sha(KEY_SHARE_1), tenant="gamma", response_cache="on", share_response_cache=True),
        ApiKeyConfig(sha256=sha(KEY_SHARE_2), tenant="delta", response_cache="on", share_response_cache=True),
        ApiKeyConfig(sha256=sha(KEY_PLAIN), tenant="acme"),
    ]
    async with open_mesh(model_dir, api_keys=keys, response_cache=ResponseCacheConfig()) as m:
        yield m


async def _post(mesh: Mesh, key: str, stream: bool = False, headers: dict[str, str] | None = None,
                **body: object) -> tuple[int, dict[str, str], str]:
    payload = {"model": MODEL, "messages": CHAT, "temperature": 0, "max_tokens": 20, "stream": stream, **body}
    async with aiohttp.ClientSession() as s, s.post(
        f"{mesh.http}/v1/chat/completions", json=payload,
        headers={"Authorization": f"Bearer {key}", **(headers or {})},
    ) as r:
        return r.status, dict(r.headers), await r.text()


def _sse_content(raw: str) -> tuple[str, list[dict]]:
    chunks = [json.loads(line[6:]) for line in raw.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices"))
    return text, chunks


def _engine_calls(mesh: Mesh) -> tuple[int, int]:
    return len(mesh.engines["engine-a"].requests), len(mesh.scheduler.admits)


async def test_a_second_greedy_request_is_replayed_without_scheduler_or_engine(mesh: Mesh) -> None:
    status, headers, first = await _post(mesh, KEY_ON, stream=True, stream_options={"include_usage": True})
    assert status == 200 and headers["X-Kvmesh-Cache"] == "miss"
    sent = mesh.engines["engine-a"].requests[0]
    _, expected = expected_answer(list(sent.prompt_token_ids), 6)
    assert _sse_content(first)[0] == expected
    before = _engine_calls(mesh)
    status, headers, again = await _post(mesh, KEY_ON, stream=True, stream_options={"include_usage": True})
    assert status == 200 and headers["X-Kvmesh-Cache"] == "hit"
    assert _engine_calls(mesh) == before                      # neither scheduler nor engine heard of it
    text, chunks = _sse_content(again)
    assert text == expected
    assert headers["Content-Type"].startswith("text/event-stream") and again.rstrip().endswith("data: [DONE]")
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert len([c for c in chunks if c.get("choices") and c["choices"][0]["delta"].get("content")]) > 1
    usage = chunks[-1]["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] == len(sent.prompt_token_ids)
    assert usage["completion_tokens"] == 6
    assert chunks[0]["id"] != _sse_content(first)[1][0]["id"]   # a new response, not the old one
    # No resume ids: no engine keeps a replay (a re-send is a hit again).
    assert "\nid: " in "\n" + first and "\nid: " not in "\n" + again
    # The same entry serves the non-streamed shape too.
    status, headers, body = await _post(mesh, KEY_ON)
    out = json.loads(body)
    assert headers["X-Kvmesh-Cache"] == "hit" and out["choices"][0]["message"]["content"] == expected
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == out["usage"]["prompt_tokens"]
    assert _engine_calls(mesh) == before


async def test_what_the_key_and_the_request_ask(mesh: Mesh) -> None:
    # Cache off for the key: no header, always generated.
    _, headers, _ = await _post(mesh, KEY_PLAIN)
    assert "X-Kvmesh-Cache" not in headers
    # Sampled (no temperature 0, no seed): never cached.
    _, headers, _ = await _post(mesh, KEY_ON, temperature=0.7)
    assert headers["X-Kvmesh-Cache"] == "bypass"
    # no-store: neither read nor written; the next request is still a miss.
    _, headers, _ = await _post(mesh, KEY_ON, headers={"Cache-Control": "no-store"})
    assert headers["X-Kvmesh-Cache"] == "bypass"
    _, headers, _ = await _post(mesh, KEY_ON)
    assert headers["X-Kvmesh-Cache"] == "miss"
    # no-cache: generated again (the engine is asked) and stored.
    calls = _engine_calls(mesh)
    _, headers, _ = await _post(mesh, KEY_ON, headers={"Cache-Control": "no-cache"})
    assert headers["X-Kvmesh-Cache"] == "bypass" and _engine_calls(mesh)[0] == calls[0] + 1
    _, headers, _ = await _post(mesh, KEY_ON)
    assert headers["X-Kvmesh-Cache"] == "hit"
    # "request" mode: only with the header; same tenant, so it reads acme's entry.
    _, headers, _ = await _post(mesh, KEY_ASK)
    assert "X-Kvmesh-Cache" not in headers
    _, headers, _ = await _post(mesh, KEY_ASK, headers={"X-Kvmesh-Cache": "on"})
    assert headers["X-Kvmesh-Cache"] == "hit"
    # A fixed seed is deterministic too; a different seed is another entry.
    _, headers, _ = await _post(mesh, KEY_ON, temperature=0.9, seed=4)
    assert headers["X-Kvmesh-Cache"] == "miss"
    _, headers, _ = await _post(mesh, KEY_ON, temperature=0.9, seed=4)
    assert headers["X-Kvmesh-Cache"] == "hit"
    _, headers, _ = await _post(mesh, KEY_ON, temperature=0.9, seed=5)
    assert headers["X-Kvmesh-Cache"] == "miss"


async def test_tenants_do_not_share_unless_their_keys_do(mesh: Mesh) -> None:
    await _post(mesh, KEY_ON)
    _, headers, _ = await _post(mesh, KEY_ON_2)
    assert headers["X-Kvmesh-Cache"] == "miss"               # beta never reads acme's entry
    _, headers, _ = await _post(mesh, KEY_SHARE_1)
    assert headers["X-Kvmesh-Cache"] == "miss"               # the shared scope is its own
    _, headers, _ = await _post(mesh, KEY_SHARE_2)
    assert headers["X-Kvmesh-Cache"] == "hit"                # another tenant, both keys share


async def test_a_failed_generation_is_not_stored(mesh: Mesh) -> None:
    mesh.engines["engine-a"].break_after = 2   # every call breaks: migrations fail too
    _, headers, raw = await _post(mesh, KEY_ON, stream=True)
    assert headers["X-Kvmesh-Cache"] == "miss" and '"error"' in raw
    mesh.engines["engine-a"].break_after = None
    _, headers, _ = await _post(mesh, KEY_ON)
    assert headers["X-Kvmesh-Cache"] == "miss"


async def test_grpc_hit_is_replayed_with_its_metadata(mesh: Mesh) -> None:
    request = inference_pb2.ChatRequest(
        model=MODEL, messages=[inference_pb2.ChatMessage(role="user", content="hello world")],
        sampling=common_pb2.SamplingParams(max_tokens=20, temperature=0.0))
    async with grpc.aio.insecure_channel(mesh.grpc_address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        results = []
        for extra in ((), (), (("cache-control", "no-store"),)):
            call = stub.Chat(request, metadata=(("authorization", f"Bearer {KEY_ON}"), *extra))
            events = [e async for e in call]
            results.append((dict(await call.initial_metadata()).get("x-kvmesh-cache"), events))
    (first_status, first), (second_status, second), (third_status, _) = results
    assert (first_status, second_status, third_status) == ("miss", "hit", "bypass")
    assert len(mesh.engines["engine-a"].requests) == 2     # the first and the no-store one
    text = ["".join(e.delta.text for e in events if e.HasField("delta")) for events in (first, second)]
    assert text[0] == text[1] and text[0]
    done = second[-1].finished
    assert done.finish_reason == common_pb2.FINISH_REASON_STOP
    assert done.usage.cached_tokens == done.usage.prompt_tokens > 0
