"""The Kubernetes probes and preStop drain on a real mesh (scheduler, two sim
engines, two gateways, Envoy: real processes on free ports), exactly as the
manifests use them: GET /health/{started,ready,live} on each metrics port,
`kvmesh drain --port <metrics port>` (the preStop hook), then SIGTERM.

- An engine drained under long streams: ready turns 503 while live stays
  200, `kvmesh drain` exits 0 once nothing runs there, the streams that
  outlived stop_grace_seconds were handed over and every stream completes
  identical to an uninterrupted run; the process is still up until SIGTERM,
  which then ends it at once.
- A gateway drained: ready 503, gRPC health NOT_SERVING, Envoy takes it out
  of rotation (its active health check fails) while requests keep flowing
  through the other gateway."""

from __future__ import annotations

import asyncio
import json
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest
from _streams import StreamResult, gateway_counter, run_streams, scheduler_state, sim_unthrottled, wait_until
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.config import MeshConfig
from services.common.proto.kvmesh.v1 import scheduler_pb2
from services.launcher.mesh import Mesh
from services.launcher.port_plan import gateway_ports

ROOT = Path(__file__).resolve().parents[2]
MESH_GATEWAYS = 2
# Outlives the drain timeout (stop_grace_seconds) by seconds on a loaded machine.
LONG_TOKENS = 1600
STOP_GRACE_SECONDS = 1.5


def MESH_TUNE(config: MeshConfig) -> None:  # noqa: N802 - the fixture's hook name
    config.engines.template.stop_grace_seconds = STOP_GRACE_SECONDS
    # A short gateway drain: nothing is in flight on the drained gateway.
    config.gateway.drain_seconds = 10.0


def _probe(port: int, name: str) -> tuple[int, str]:
    """GET /health/<name> on a metrics port: (status code, JSON status)."""
    url = f"http://127.0.0.1:{port}/health/{name}"
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, json.loads(response.read())["status"]
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())["status"]


def _probes(port: int) -> dict[str, int]:
    return {name: _probe(port, name)[0] for name in ("started", "ready", "live")}


async def _kvmesh_drain(port: int) -> tuple[int, str]:
    """The preStop hook: `kvmesh drain --port PORT`; (exit code, output)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "services.cli", "drain", "--port", str(port), "--timeout", "120",
        cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    out, _ = await asyncio.wait_for(proc.communicate(), 150)
    assert proc.returncode is not None
    return proc.returncode, out.decode()


def _engine_state(mesh: Mesh, engine_id: str) -> scheduler_pb2.EngineState | None:
    state = scheduler_state(mesh)
    if state is None:
        return None
    return next((e for e in state.engines if e.engine_id == engine_id), None)


async def _expected(mesh: Mesh, prompts: list[str], lengths: list[int]) -> list[str]:
    """The uninterrupted answers (the sim unthrottled: only their text counts)."""
    with sim_unthrottled(mesh):
        _, tasks, session = await run_streams(mesh, prompts, lengths)
        try:
            results = await asyncio.gather(*tasks)
        finally:
            await session.close()
    assert all(r.ok for r in results), "baseline run failed"
    return [r.text for r in results]


def _assert_complete(results: list[StreamResult], expected: list[str]) -> None:
    failed = [(i, r.status, r.finish_reason, r.error) for i, r in enumerate(results) if not r.ok]
    assert not failed, f"{len(failed)} streams did not complete: {failed[:5]}"
    differ = [i for i, (r, want) in enumerate(zip(results, expected, strict=True)) if r.text != want]
    assert not differ, f"streams {differ} differ from the uninterrupted run"


async def test_prestop_drain_hands_engine_streams_over_then_sigterm_is_quick(e2e_mesh: Mesh) -> None:
    mesh = e2e_mesh
    port = mesh.config.engine_config(1).metrics_port
    assert port, "engines serve no metrics port"
    assert await asyncio.to_thread(_probes, port) == {"started": 200, "ready": 200, "live": 200}
    n = 16
    prompts = [f"probe drain {i}: tell me a long story about meshes." for i in range(n)]
    lengths = [30 if i % 2 else LONG_TOKENS for i in range(n)]
    expected = await _expected(mesh, prompts, lengths)
    migrations = sum(gateway_counter(mesh, "kvmesh_gateway_migrations_total", replica=r) for r in range(2))

    results, tasks, session = await run_streams(mesh, prompts, lengths)
    try:
        await wait_until(lambda: all(r.chunks > 0 for r in results), 60, "every stream to be running")
        held = _engine_state(mesh, "engine-1")
        assert held is not None and held.leases > 0, "engine-1 holds no stream"
        drain = asyncio.create_task(_kvmesh_drain(port))
        await wait_until(lambda: _probe(port, "ready")[0] == 503, 30, "engine-1 to turn unready")
        assert _probe(port, "ready") == (503, "draining")
        assert _probe(port, "live") == (200, "ok")  # draining is no reason to restart it
        code, output = await drain
        assert code == 0, output
        report = json.loads(output.split("kvmesh drain: ", 1)[1])
        assert report["status"] == "drained" and report["handed_over"] >= 1, report
        results = list(await asyncio.gather(*tasks))
    finally:
        await session.close()
    _assert_complete(results, expected)
    moved = sum(gateway_counter(mesh, "kvmesh_gateway_migrations_total", replica=r) for r in range(2))
    assert moved - migrations >= report["handed_over"] > 0

    # Drained, not gone: up until the kubelet's SIGTERM, which ends it at once.
    assert mesh.is_running("engine-1")
    assert await asyncio.to_thread(_probes, port) == {"started": 200, "ready": 503, "live": 200}
    began = time.monotonic()
    mesh.terminate("engine-1")
    assert mesh.wait("engine-1", timeout=30) == 0
    stopped = time.monotonic() - began
    print(f"preStop drain: {n} streams complete, {report['handed_over']} handed over; SIGTERM took {stopped:.2f} s")
    assert stopped < 10

    mesh.restart("engine-1")
    await wait_until(lambda: _probe(port, "ready")[0] == 200, 60, "engine-1 to serve again")
    assert mesh.exited() == []


def _grpc_health(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="kvmesh.v1.Inference"), timeout=10)
        return int(reply.status)


def _envoy_flags(mesh: Mesh, port: int) -> list[str]:
    """Envoy's health flags for every upstream host on `port` (/clusters)."""
    url = f"http://127.0.0.1:{mesh.endpoints.admin_port}/clusters"
    with urllib.request.urlopen(url, timeout=10) as response:
        lines = response.read().decode().splitlines()
    return [line.rsplit("::", 1)[1] for line in lines if f":{port}::health_flags::" in line]


async def test_prestop_drain_takes_a_gateway_out_of_envoy(e2e_mesh: Mesh) -> None:
    mesh = e2e_mesh
    http_port, grpc_port, port = gateway_ports(mesh.config, 1)
    assert await asyncio.to_thread(_probes, port) == {"started": 200, "ready": 200, "live": 200}
    in_rotation = _envoy_flags(mesh, http_port) + _envoy_flags(mesh, grpc_port)
    assert in_rotation and all(f == "healthy" for f in in_rotation), in_rotation
    code, output = await _kvmesh_drain(port)
    assert code == 0, output
    assert _probe(port, "ready") == (503, "draining")
    assert _probe(port, "live") == (200, "ok")
    assert _grpc_health(f"127.0.0.1:{grpc_port}") == health_pb2.HealthCheckResponse.NOT_SERVING
    await wait_until(lambda: all("failed_active_hc" in f for f in _envoy_flags(mesh, http_port) +
                                 _envoy_flags(mesh, grpc_port)), 30, "Envoy to take gateway-1 out")
    # Requests flow on through gateway-0.
    results, tasks, session = await run_streams(mesh, [f"after gateway drain {i}" for i in range(6)], [16] * 6)
    try:
        results = list(await asyncio.gather(*tasks))
    finally:
        await session.close()
    assert all(r.ok for r in results), [r.error for r in results]

    began = time.monotonic()
    mesh.terminate("gateway-1")
    assert mesh.wait("gateway-1", timeout=30) == 0
    assert time.monotonic() - began < 10
    mesh.restart("gateway-1")
    await wait_until(lambda: _probe(port, "ready")[0] == 200, 60, "gateway-1 to serve again")
    assert mesh.exited() == []


pytestmark = pytest.mark.timeout(300)
