"""A gateway's drain (services/gateway/drain.py): not ready at once, still
serving -- new requests too -- until nothing is in flight, and at the bound
the open streams are cut without a polite cancel to their engines."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import grpc
import pytest
from conftest import KEY_FULL, MODEL, Mesh, open_mesh
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.config import ConfigError, MeshConfig, load_config, validate_config
from services.gateway.drain import DrainSettings
from services.gateway.server import GatewayService

CHAT = [{"role": "user", "content": "hello drain"}]
HEADERS = {"Authorization": f"Bearer {KEY_FULL}"}


async def _stream(session: aiohttp.ClientSession, mesh: Mesh) -> tuple[int, str]:
    """A streamed chat: (status, the raw SSE body)."""
    body = {"model": MODEL, "messages": CHAT, "stream": True, "max_tokens": 20}
    async with session.post(f"{mesh.http}/v1/chat/completions", json=body, headers=HEADERS) as r:
        return r.status, await r.text()


async def _grpc_health(mesh: Mesh) -> int:
    async with grpc.aio.insecure_channel(mesh.grpc_address) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="kvmesh.v1.Inference"), timeout=10)
        return int(reply.status)


async def _until(predicate: object, what: str, timeout: float = 20.0) -> None:
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.01)


def _service(mesh: Mesh) -> GatewayService:
    assert isinstance(mesh.gateway, GatewayService)
    return mesh.gateway


async def test_drain_fails_health_serves_new_requests_and_waits_for_streams(model_dir: Path) -> None:
    async with open_mesh(model_dir, drain_seconds=120.0, drain_unready_seconds=0.0) as mesh:
        service = _service(mesh)
        streams = service.metrics.active_streams
        mesh.scheduler.queue_hold = asyncio.Event()  # requests stay in flight until released
        async with aiohttp.ClientSession() as session:
            # Health follows the scheduler channel, which a background task
            # sees READY a moment after the mesh opens (a fresh-clone CI run
            # asked before): SERVING before the drain, within a bound.
            async with asyncio.timeout(20):
                while await _grpc_health(mesh) != health_pb2.HealthCheckResponse.SERVING:
                    await asyncio.sleep(0.05)
            first = asyncio.create_task(_stream(session, mesh))
            await _until(lambda: streams.count == 1, "the first request in flight")
            drain = asyncio.create_task(service.drain())
            await _until(lambda: service.drain_state.draining, "the drain to begin")
            async with session.get(f"{mesh.http}/health") as r:
                assert r.status == 503
                assert (await r.json())["error"]["code"] == "draining"
            assert await _grpc_health(mesh) == health_pb2.HealthCheckResponse.NOT_SERVING
            # A request the load balancer still sends is served, not refused.
            second = asyncio.create_task(_stream(session, mesh))
            await _until(lambda: streams.count == 2, "the second request in flight")
            assert not drain.done(), "the drain ended with requests in flight"
            mesh.scheduler.queue_hold.set()
            for status, text in await asyncio.gather(first, second):
                assert status == 200 and text.rstrip().endswith("data: [DONE]"), text[-200:]
            assert await asyncio.wait_for(drain, 20) == 0
        # Still not ready after the drain, whatever the scheduler channel does.
        assert await _grpc_health(mesh) == health_pb2.HealthCheckResponse.NOT_SERVING


async def test_streams_open_at_the_bound_are_cut_without_a_polite_cancel(model_dir: Path) -> None:
    async with open_mesh(model_dir, drain_seconds=0.5, drain_unready_seconds=0.0) as mesh:
        service = _service(mesh)
        engine = mesh.engines["engine-a"]
        engine.answer_tokens, engine.pause_after = 1000, 2  # never ends on its own
        async with aiohttp.ClientSession() as session:
            stream = asyncio.create_task(_stream(session, mesh))
            await asyncio.wait_for(engine.paused.wait(), 20)
            open_streams = await service.drain()
            assert open_streams == 1
            exits: list[int] = []
            service.drain_state.cut(open_streams, exit_process=exits.append)
            assert exits == [0]
            assert service.metrics.drain_cut._value.get() == 1
            # The drain itself sent the engine nothing: its generation runs on.
            assert engine.cancels == 0 and not engine.cancelled.is_set()
            stream.cancel()
            await asyncio.gather(stream, return_exceptions=True)


def test_drain_bounds_are_validated() -> None:
    config = MeshConfig()
    config.gateway.drain_seconds, config.gateway.drain_unready_seconds = 2.0, 5.0
    with pytest.raises(ConfigError, match=r"gateway\.drain_unready_seconds"):
        validate_config(config)
    config.gateway.drain_seconds = -1.0
    with pytest.raises(ConfigError, match=r"gateway\.drain_seconds"):
        validate_config(config)


def test_the_default_drain_bound_is_the_generation_bound() -> None:
    """Unset drain_seconds = the generation bound after the load balancer's:
    a request the load balancer sends at the last moment still gets its whole
    generation before the cut (issue 29: a fixed 30 s cut plain clients)."""
    config = MeshConfig()
    assert config.gateway.drain_seconds is None
    validate_config(config)
    assert config.gateway.drain_bound_seconds == 123.0
    assert DrainSettings.from_config(config.gateway) == DrainSettings(123.0, 3.0)
    config.gateway.max_generation_seconds = 40.0
    assert DrainSettings.from_config(config.gateway).drain_seconds == 43.0
    config.gateway.drain_seconds = 10.0  # explicit: every client resumes
    assert DrainSettings.from_config(config.gateway) == DrainSettings(10.0, 3.0)
    shipped = load_config(Path(__file__).parents[3] / "config" / "kvmesh.yaml")
    assert shipped.gateway.drain_seconds is None and shipped.gateway.drain_bound_seconds == 123.0
