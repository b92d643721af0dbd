"""The long-stream e2e run (test_e2e_long_stream.py), as a script: a sim
mesh slowed to ~12 s per token behind an edge whose stream idle timeout is
10 s, three streams side by side for > 120 s (OpenAI SSE, the transcoded
SSE bridge, native gRPC), then the mesh stops. Prints what the test
asserts, as one JSON line.

Why a script: the run is two minutes of waiting (a token every 12 s, a
heartbeat every 3 s) and almost no CPU. tests/e2e/conftest.py starts it
in the background as soon as the test is collected, so it runs beside the
tests before it instead of adding two minutes to the suite; the test then
reads its result. Its own process: nothing shared with pytest's (event
loops, gRPC), and it stops its mesh itself however pytest ends.

    python tests/e2e/_long_stream.py RUN_DIR
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
if str(ROOT / "tests") not in sys.path:
    sys.path.insert(0, str(ROOT / "tests"))

import aiohttp  # noqa: E402
import grpc  # noqa: E402
from _mesh_stop import stop_test_mesh  # noqa: E402

from services.common.config import MeshConfig, load_config  # noqa: E402
from services.common.proto.kvmesh.v1 import common_pb2, inference_pb2, inference_pb2_grpc  # noqa: E402
from services.launcher.mesh import Mesh, MeshOptions, start_on_free_ports  # noqa: E402

MODEL = "tiny-llama"
TOPOLOGY = "tests/e2e/topology-long-stream.yaml"
TOKENS = 10
# 8 ms per decode step x 1500 = 12 s per token.
SPEED_FACTOR = 1500.0
HEARTBEAT_SECONDS = 3.0


def tune(config: MeshConfig) -> None:
    config.envoy.topology = TOPOLOGY
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


def run(run_dir: Path) -> dict[str, Any]:
    """Start the mesh (as tests/conftest.py's e2e_mesh does, with `tune`),
    run the three streams, stop the mesh; what the test asserts."""
    config = load_config(ROOT / "config" / "kvmesh.yaml")
    config.engines.template.sim.speed_factor = 0.5
    tune(config)
    options = MeshOptions(engines=2, backend="sim", gateways=1, model=MODEL, free_ports=True, run_dir=run_dir)
    mesh = start_on_free_ports(config, options)
    try:
        async def streams() -> tuple[Any, ...]:
            return tuple(await asyncio.wait_for(
                asyncio.gather(_openai(mesh), _bridge(mesh), _grpc(mesh)), timeout=400))

        started = time.monotonic()
        openai_result, bridge_kinds, grpc_kinds = asyncio.run(streams())
        return {"elapsed": time.monotonic() - started, "openai": list(openai_result), "bridge": bridge_kinds,
                "grpc": grpc_kinds, "exited": [str(e) for e in mesh.exited()], "logs": str(mesh.log_dir)}
    finally:
        stop_test_mesh(mesh)


if __name__ == "__main__":
    # SIGTERM (pytest ending early) unwinds like an exception: the mesh stops.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        print(json.dumps(run(Path(sys.argv[1]))), flush=True)
    except BaseException as exc:  # the test shows it
        print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}), flush=True)
        raise
