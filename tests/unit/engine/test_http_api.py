"""The engine's OpenAI-compatible HTTP endpoint (for other routers)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import aiohttp
import pytest
from engine_helpers import engine_config, free_port, mesh_config

from services.engine.server import EngineService


@pytest.fixture
async def http() -> AsyncIterator[tuple[EngineService, str]]:
    port = free_port()
    svc = EngineService(mesh_config(), engine_config(http_port=port))
    await svc.start()
    try:
        yield svc, f"http://127.0.0.1:{port}"
    finally:
        await svc.stop()


async def test_completions_with_token_ids_match_the_grpc_tokens(http) -> None:
    svc, base = http
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{base}/health") as resp:
            assert resp.status == 200
        async with session.get(f"{base}/v1/models") as resp:
            assert (await resp.json())["data"][0]["id"] == "sim"
        body = {"model": "sim", "prompt": [300, 301, 302], "max_tokens": 7}
        async with session.post(f"{base}/v1/completions", json=body) as resp:
            whole = await resp.json()
        choice = whole["choices"][0]
        assert choice["finish_reason"] == "length" and len(choice["token_ids"]) == 7
        assert whole["usage"]["completion_tokens"] == 7 and whole["usage"]["prompt_tokens"] == 3
        async with session.post(f"{base}/v1/completions", json={**body, "stream": True}) as resp:
            assert resp.headers["Content-Type"].startswith("text/event-stream")
            raw = (await resp.read()).decode()
    events = [line[6:] for line in raw.split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == choice["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert svc.backend.load().blocks_used == 0


async def test_chat_and_errors(http) -> None:
    _, base = http
    async with aiohttp.ClientSession() as session:
        chat = {"model": "sim", "messages": [{"role": "user", "content": "lorem ipsum"}], "max_tokens": 4}
        async with session.post(f"{base}/v1/chat/completions", json=chat) as resp:
            body = await resp.json()
        assert body["object"] == "chat.completion"
        assert body["choices"][0]["message"]["content"]
        async with session.post(f"{base}/v1/completions", json={"prompt": [], "max_tokens": 3}) as resp:
            assert resp.status == 400
            assert "empty" in (await resp.json())["error"]["message"]
        async with session.post(f"{base}/v1/completions", data=b"not json") as resp:
            assert resp.status == 400


async def test_render_endpoints_return_the_prompt_token_ids(http) -> None:
    # vllm-router's cache_aware policy asks every worker for these (BENCHMARKS.md peers).
    svc, base = http
    async with aiohttp.ClientSession() as session:
        body = {"model": "sim", "prompt": [300, 301, 302], "max_tokens": 2}
        async with session.post(f"{base}/v1/completions/render", json=body) as resp:
            rendered = await resp.json()
        assert resp.status == 200 and rendered[0]["token_ids"] == [300, 301, 302]
        chat = {"model": "sim", "messages": [{"role": "user", "content": "lorem ipsum"}], "max_tokens": 2}
        async with session.post(f"{base}/v1/chat/completions/render", json=chat) as resp:
            rendered = await resp.json()
        assert resp.status == 200 and rendered["token_ids"]
        async with session.post(f"{base}/v1/chat/completions", json=chat) as resp:
            usage = (await resp.json())["usage"]
        assert usage["prompt_tokens"] == len(rendered["token_ids"])
        async with session.post(f"{base}/v1/chat/completions/render", json={"messages": []}) as resp:
            assert resp.status == 400
        # Tool calls are read out of the text by the gateway; an engine's own endpoint refuses tools.
        tool = {"type": "function", "function": {"name": "f"}}
        async with session.post(f"{base}/v1/chat/completions", json={**chat, "tools": [tool]}) as resp:
            assert resp.status == 400 and (await resp.json())["error"]["param"] == "tools"
    assert svc.backend.load().running == 0


async def test_engine_only_fields_and_error_shape(http) -> None:
    # Peers and load generators may leave out the model (the engine serves one)
    # and send vLLM's extensions; errors are the gateway's OpenAI error JSON.
    _, base = http
    async with aiohttp.ClientSession() as session:
        body = {"prompt": [300, 301], "max_tokens": 5, "ignore_eos": True, "min_tokens": 5, "priority": 0}
        async with session.post(f"{base}/v1/completions", json=body) as resp:
            assert resp.status == 200
            whole = await resp.json()
        assert whole["model"] == "sim" and len(whole["choices"][0]["token_ids"]) == 5
        async with session.post(f"{base}/v1/completions", json={**body, "priority": "high"}) as resp:
            assert resp.status == 400
            assert (await resp.json())["error"]["param"] == "priority"
        async with session.post(f"{base}/v1/completions", json={**body, "temperature": 9}) as resp:
            error = (await resp.json())["error"]
        assert resp.status == 400 and error["param"] == "temperature" and error["type"] == "invalid_request_error"
        stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
        async with session.post(f"{base}/v1/chat/completions", json={**stream, "messages": [
                {"role": "user", "content": "lorem"}]}) as resp:
            raw = (await resp.read()).decode()
    events = [json.loads(line[6:]) for line in raw.split("\n") if line.startswith("data: {")]
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 5
