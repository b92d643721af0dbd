"""The whole mesh through the real Envoy: scheduler, two sim engines, one
gateway, Envoy, all real processes on free ports (one mesh for this module,
see tests/conftest.py). What a user of `kvmesh up` does, checked end to end."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import aiohttp
import grpc
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from services.common.proto.kvmesh.v1 import common_pb2, engine_pb2, engine_pb2_grpc, inference_pb2, inference_pb2_grpc
from services.launcher.mesh import Mesh
from services.launcher.up import examples

ROOT = Path(__file__).resolve().parents[2]
MODEL = "tiny-llama"
GRPCURL = str(Path(sys.prefix) / "bin" / "grpcurl")
MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Tell me a story about a mesh."}]


def _auth(mesh: Mesh) -> dict[str, str]:
    return {"Authorization": f"Bearer {mesh.api_key}"}


def _wait_for(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    assert predicate(), f"timed out after {timeout} s waiting for {what}"


def _engine_infos(mesh: Mesh) -> list[engine_pb2.EngineInfo]:
    infos = []
    for address in mesh.endpoints.engines:
        with grpc.insecure_channel(address) as channel:
            infos.append(engine_pb2_grpc.EngineStub(channel).GetInfo(engine_pb2.GetInfoRequest(), timeout=5))
    return infos


def _aborted_total(mesh: Mesh) -> float:
    """Sum of vllm:request_success_total{finished_reason=~"abort"} over engines."""
    total = 0.0
    for i in range(mesh.config.engines.count):
        port = mesh.config.engine_config(i).metrics_port
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            text = resp.read().decode()
        for line in text.splitlines():
            if line.startswith("vllm:request_success_total{") and 'finished_reason="abort' in line:
                total += float(line.rsplit(" ", 1)[1])
    return total


def _assert_mesh_alive(mesh: Mesh) -> None:
    assert mesh.exited() == [], "a service died"
    for name in mesh.names:
        assert mesh.is_running(name), f"{name} is not running; log:\n{mesh.log_tail(name)}"


# ---------------------------------------------------------------- HTTP / SSE


async def test_sse_stream_arrives_chunk_by_chunk(e2e_mesh: Mesh) -> None:
    body = {"model": MODEL, "messages": MESSAGES, "stream": True, "max_tokens": 48}
    chunks: list[dict] = []
    done = False
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{e2e_mesh.endpoints.public_http}/v1/chat/completions",
                                json=body, headers=_auth(e2e_mesh)) as resp:
            assert resp.status == 200, await resp.text()
            assert resp.headers["Content-Type"].startswith("text/event-stream")
            assert resp.headers.get("x-request-id")
            while True:
                line = await asyncio.wait_for(resp.content.readline(), timeout=60)
                if not line:
                    break
                text = line.decode().strip()
                if not text.startswith("data:"):
                    continue
                data = text[len("data:"):].strip()
                if data == "[DONE]":
                    done = True
                    continue
                assert not done, "nothing may follow [DONE]"
                chunks.append(json.loads(data))
                if len(chunks) == 1:
                    # The first event is here while the answer is still being generated.
                    assert not resp.content.at_eof()
    assert done
    assert len(chunks) >= 2
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text
    reasons = [c["choices"][0].get("finish_reason") for c in chunks if c["choices"]]
    assert reasons[-1] in ("length", "stop")


async def test_non_streaming_answer_has_usage(e2e_mesh: Mesh) -> None:
    body = {"model": MODEL, "messages": MESSAGES, "stream": False, "max_tokens": 16}
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{e2e_mesh.endpoints.public_http}/v1/chat/completions",
                                json=body, headers=_auth(e2e_mesh)) as resp:
            assert resp.status == 200, await resp.text()
            answer = await resp.json()
    assert answer["object"] == "chat.completion"
    assert answer["model"] == MODEL
    assert answer["choices"][0]["message"]["role"] == "assistant"
    assert answer["choices"][0]["message"]["content"]
    usage = answer["usage"]
    assert usage["prompt_tokens"] > 0
    assert 0 < usage["completion_tokens"] <= 16
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def test_openai_client_streams_a_chat_answer(e2e_mesh: Mesh) -> None:
    client = openai.OpenAI(base_url=f"{e2e_mesh.endpoints.public_http}/v1", api_key=e2e_mesh.api_key,
                           max_retries=0, timeout=60)
    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True, max_tokens=24)
    pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert len(pieces) >= 2
    assert "".join(pieces)
    models = [m.id for m in client.models.list()]
    assert MODEL in models


def test_printed_curl_example_works(e2e_mesh: Mesh) -> None:
    ex = examples(e2e_mesh.endpoints, e2e_mesh.api_key, MODEL)
    out = subprocess.run(ex.curl, shell=True, capture_output=True, text=True,  # noqa: S602 - as a user pastes it
                         timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    assert "chat.completion.chunk" in out.stdout
    assert out.stdout.rstrip().endswith("data: [DONE]")


# ---------------------------------------------------------------- errors


def _too_long_prompt() -> str:
    config = json.loads((ROOT / ".models" / MODEL / "config.json").read_text())
    # One token per " hello" in SmolLM2's tokenizer; twice the context to be sure.
    return "hello " * (2 * int(config["max_position_embeddings"]))


@pytest.mark.parametrize(
    ("name", "make_body"),
    [
        ("malformed JSON", lambda: b'{"model": "tiny-llama", "messages": [}'),
        ("missing messages", lambda: json.dumps({"model": MODEL}).encode()),
        ("unknown model", lambda: json.dumps({"model": "no-such-model", "messages": MESSAGES}).encode()),
        ("prompt longer than the context", lambda: json.dumps(
            {"model": MODEL, "messages": [{"role": "user", "content": _too_long_prompt()}]}).encode()),
        ("body over 1 MiB", lambda: json.dumps(
            {"model": MODEL, "messages": [{"role": "user", "content": "x" * 1_100_000}]}).encode()),
    ],
)
async def test_bad_requests_get_openai_errors_and_the_mesh_survives(
    e2e_mesh: Mesh, name: str, make_body: Callable[[], bytes]
) -> None:
    headers = {**_auth(e2e_mesh), "Content-Type": "application/json"}
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{e2e_mesh.endpoints.public_http}/v1/chat/completions",
                                data=make_body(), headers=headers) as resp:
            assert 400 <= resp.status < 500, f"{name}: {resp.status} {await resp.text()}"
            error = (await resp.json(content_type=None))["error"]
            assert error["message"], name
        # The mesh still answers.
        ok = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4}
        async with session.post(f"{e2e_mesh.endpoints.public_http}/v1/chat/completions",
                                json=ok, headers=_auth(e2e_mesh)) as resp:
            assert resp.status == 200, await resp.text()
    _assert_mesh_alive(e2e_mesh)


async def test_missing_api_key_is_401(e2e_mesh: Mesh) -> None:
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{e2e_mesh.endpoints.public_http}/v1/chat/completions",
                                json={"model": MODEL, "messages": MESSAGES}) as resp:
            assert resp.status == 401
            assert (await resp.json())["error"]["message"]


# ---------------------------------------------------------------- gRPC


def test_grpcurl_lists_the_inference_service(e2e_mesh: Mesh) -> None:
    out = subprocess.run([GRPCURL, "-plaintext", e2e_mesh.endpoints.public_grpc, "list"],
                         capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    assert "kvmesh.v1.Inference" in out.stdout.split()


def test_printed_grpcurl_example_streams_deltas(e2e_mesh: Mesh) -> None:
    ex = examples(e2e_mesh.endpoints, e2e_mesh.api_key, MODEL)
    out = subprocess.run(ex.grpcurl, shell=True, capture_output=True, text=True,  # noqa: S602 - as a user pastes it
                         timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    assert len(re.findall(r'"delta"', out.stdout)) >= 2
    assert '"finished"' in out.stdout


def test_grpc_client_through_envoy(e2e_mesh: Mesh) -> None:
    meta = [("authorization", f"Bearer {e2e_mesh.api_key}")]
    with grpc.insecure_channel(e2e_mesh.endpoints.public_grpc) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        models = stub.ListModels(inference_pb2.ListModelsRequest(), metadata=meta, timeout=30)
        assert MODEL in [m.id for m in models.models]
        request = inference_pb2.ChatRequest(
            model=MODEL, messages=[inference_pb2.ChatMessage(role="user", content="hi")],
            sampling=common_pb2.SamplingParams(max_tokens=12),
        )
        events = list(stub.Chat(request, metadata=meta, timeout=60))
        kinds = [e.WhichOneof("event") for e in events]
        assert kinds.count("delta") >= 1 and kinds[-1] == "finished"
        assert events[-1].finished.usage.completion_tokens == sum(len(e.delta.token_ids) for e in events)
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Chat(inference_pb2.ChatRequest(model="no-such-model", messages=request.messages),
                           metadata=meta, timeout=30))
        assert info.value.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT)


# ---------------------------------------------------------------- disconnect


async def test_client_leaving_mid_stream_frees_the_engine_blocks(e2e_mesh: Mesh) -> None:
    _wait_for(lambda: all(i.running == 0 and i.blocks_used == 0 for i in _engine_infos(e2e_mesh)),
              30, "idle engines before the test")
    aborted_before = _aborted_total(e2e_mesh)
    body = {"model": MODEL, "stream": True, "max_tokens": 1500,
            "messages": [{"role": "user", "content": "Write a very long essay about disconnects."}]}
    session = aiohttp.ClientSession()
    try:
        resp = await session.post(f"{e2e_mesh.endpoints.public_http}/v1/chat/completions",
                                  json=body, headers=_auth(e2e_mesh))
        assert resp.status == 200, await resp.text()
        seen = 0
        while seen < 3:
            line = await asyncio.wait_for(resp.content.readline(), timeout=60)
            assert line, "stream ended early"
            seen += line.startswith(b"data:")
        busy = await asyncio.to_thread(_engine_infos, e2e_mesh)
        assert sum(i.blocks_used for i in busy) > 0 and sum(i.running for i in busy) == 1
        resp.close()  # the client goes away mid-stream
    finally:
        await session.close()

    def released() -> bool:
        return all(i.running == 0 and i.blocks_used == 0 for i in _engine_infos(e2e_mesh))

    await asyncio.to_thread(_wait_for, released, 30, "the engine to free the blocks")
    # Freed by an abort, not by the generation running to its end.
    await asyncio.to_thread(_wait_for, lambda: _aborted_total(e2e_mesh) > aborted_before, 30,
                            "the engine to count an aborted request")
    _assert_mesh_alive(e2e_mesh)
