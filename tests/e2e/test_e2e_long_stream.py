"""A stream longer than two minutes through the real Envoy is not cut.

The sim is slowed so that one token takes ~12 s, longer than this edge's
stream idle timeout (10 s): only the gateway's heartbeats (every 3 s: SSE
comments on the OpenAI route, heartbeat events on gRPC and the bridge) keep
the streams alive. Three streams run side by side for > 120 s: OpenAI SSE
(HTTP/1.1 upstream), the transcoded SSE bridge and native gRPC (HTTP/2
upstream). Deliberately one long test.
"""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import grpc

from services.common.config import MeshConfig
from services.common.proto.kvmesh.v1 import common_pb2, inference_pb2, inference_pb2_grpc
from services.launcher.mesh import Mesh

MODEL = "tiny-llama"
MESH_TOPOLOGY = "tests/e2e/topology-long-stream.yaml"
TOKENS = 10
# 8 ms per decode step x 1500 = 12 s per token.
SPEED_FACTOR = 1500.0
HEARTBEAT_SECONDS = 3.0


def MESH_TUNE(config: MeshConfig) -> None:  # noqa: N802 - the fixture's hook name
    config.engines.template.sim.speed_factor = SPEED_FACTOR
    # The sim's 2-token warm-up would take ~24 s at this speed before the
    # engines report healthy; these streams need no warm engine.
    config.engines.template.sim.warm_up = False
    config.gateway.heartbeat_seconds = HEARTBEAT_SECONDS
    # The gateway's default 120 s cap would end these streams with a timeout.
    config.gateway.max_generation_seconds = 600.0


async def _openai(mesh: Mesh) -> tuple[int, int, str | None]:
    """(content chunks, heartbeat comments, finish reason)."""
    body = {"model": MODEL, "stream": True, "max_tokens": TOKENS,
            "messages": [{"role": "user", "content": "Take your time."}]}
    chunks = heartbeats = 0
    reason = None
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
        async with session.post(f"{mesh.endpoints.public_http}/v1/chat/completions", json=body,
                                headers={"Authorization": f"Bearer {mesh.api_key}"}) as resp:
            assert resp.status == 200, await resp.text()
            async for raw in resp.content:
                line = raw.decode().strip()
                if line.startswith(":"):
                    heartbeats += 1
                elif line.startswith("data:") and line != "data: [DONE]":
                    chunk = json.loads(line[5:])
                    for choice in chunk.get("choices", []):
                        chunks += bool(choice["delta"].get("content"))
                        reason = choice.get("finish_reason") or reason
    return chunks, heartbeats, reason


async def _bridge(mesh: Mesh) -> list[str]:
    body = {"model": MODEL, "prompt": "Slowly now.", "sampling": {"max_tokens": TOKENS}}
    kinds = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
        async with session.post(f"{mesh.endpoints.public_http}/v1/generate", json=body,
                                headers={"Authorization": f"Bearer {mesh.api_key}"}) as resp:
            assert resp.status == 200, await resp.text()
            async for raw in resp.content:
                if raw.startswith(b"data:"):
                    event = json.loads(raw[5:])
                    kinds.append(next(k for k in ("queued", "delta", "finished", "heartbeat") if k in event))
    return kinds


async def _grpc(mesh: Mesh) -> list[str]:
    async with grpc.aio.insecure_channel(mesh.endpoints.public_grpc) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        request = inference_pb2.GenerateRequest(model=MODEL, prompt="Patience.",
                                                sampling=common_pb2.SamplingParams(max_tokens=TOKENS))
        call = stub.Generate(request, metadata=[("authorization", f"Bearer {mesh.api_key}")])
        return [e.WhichOneof("event") async for e in call]


async def test_streams_over_two_minutes_with_heartbeats_are_not_cut(e2e_mesh: Mesh) -> None:
    started = time.monotonic()
    openai_result, bridge_kinds, grpc_kinds = await asyncio.wait_for(
        asyncio.gather(_openai(e2e_mesh), _bridge(e2e_mesh), _grpc(e2e_mesh)), timeout=400)
    elapsed = time.monotonic() - started
    assert elapsed > 120, f"the streams took only {elapsed:.0f} s; the test needs more than two minutes"
    chunks, heartbeats, reason = openai_result
    assert reason == "length" and chunks >= 1
    assert heartbeats >= 10
    for kinds in (bridge_kinds, grpc_kinds):
        assert kinds[-1] == "finished", kinds
        assert kinds.count("heartbeat") >= 10
        assert kinds.count("delta") >= 1
    assert e2e_mesh.exited() == []
