"""The gateway's probes and POST /drain on its metrics port: ready follows
the scheduler channel and turns 503 for good once draining (gRPC health,
which Envoy checks, NOT_SERVING with it); /drain answers when nothing is in
flight, or at drain_seconds with what is still open (SIGTERM then cuts it)."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import socket
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
from conftest import Mesh, open_mesh
from grpc_health.v1 import health_pb2
from test_gateway_drain import _grpc_health, _service, _stream, _until

from services.common.health_http import request_drain


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.asynccontextmanager
async def _metrics_mesh(model_dir: Path, **gateway: object) -> AsyncIterator[Mesh]:
    """open_mesh with the metrics port on: a port free when picked can be
    taken before the gateway binds it (another xdist worker, the fake
    scheduler's own port 0), so a taken one is picked again."""
    for attempt in range(5):
        try:
            opened = open_mesh(model_dir, None, metrics_port=_free_port(), **gateway)
            mesh = await opened.__aenter__()
        except OSError as error:
            if error.errno != errno.EADDRINUSE or attempt == 4:
                raise
            continue
        break
    try:
        yield mesh
    except BaseException as error:
        if not await opened.__aexit__(type(error), error, error.__traceback__):
            raise
    else:
        await opened.__aexit__(None, None, None)


def _base(mesh: Mesh) -> str:
    return f"http://127.0.0.1:{_service(mesh).metrics_port}"


async def _probe(session: aiohttp.ClientSession, mesh: Mesh, name: str) -> tuple[int, str]:
    async with session.get(f"{_base(mesh)}/health/{name}") as response:
        return response.status, (await response.json())["status"]


async def _until_probe(session: aiohttp.ClientSession, mesh: Mesh, name: str, code: int) -> None:
    async with asyncio.timeout(30):
        while (await _probe(session, mesh, name))[0] != code:
            await asyncio.sleep(0.02)


async def test_drain_over_http_turns_unready_and_answers_when_drained(model_dir: Path) -> None:
    async with _metrics_mesh(model_dir, drain_seconds=120.0,
                         drain_unready_seconds=0.0) as mesh:
        service = _service(mesh)
        streams = service.metrics.active_streams
        async with aiohttp.ClientSession() as session:
            await _until_probe(session, mesh, "ready", 200)
            assert await _probe(session, mesh, "started") == (200, "ok")
            assert await _probe(session, mesh, "live") == (200, "ok")
            async with session.get(f"{_base(mesh)}/metrics") as r:
                assert "kvmesh_gateway_active_streams" in await r.text()
            mesh.scheduler.queue_hold = asyncio.Event()  # requests stay in flight until released
            first = asyncio.create_task(_stream(session, mesh))
            await _until(lambda: streams.count == 1, "a request in flight")
            drain = asyncio.create_task(session.post(f"{_base(mesh)}/drain"))
            await _until_probe(session, mesh, "ready", 503)
            assert await _probe(session, mesh, "ready") == (503, "draining")
            assert await _probe(session, mesh, "live") == (200, "ok")
            assert await _grpc_health(mesh) == health_pb2.HealthCheckResponse.NOT_SERVING  # Envoy's check
            async with session.get(f"{mesh.http}/health") as r:
                assert r.status == 503
            # Still serving what the load balancer sends until it notices.
            second = asyncio.create_task(_stream(session, mesh))
            await _until(lambda: streams.count == 2, "a second request in flight")
            await asyncio.sleep(0.1)
            assert not drain.done(), "/drain answered with requests in flight"
            mesh.scheduler.queue_hold.set()
            for status, text in await asyncio.gather(first, second):
                assert status == 200 and text.rstrip().endswith("data: [DONE]"), text[-200:]
            async with await asyncio.wait_for(drain, 30) as response:
                assert response.status == 200
                report = await response.json()
            assert report["status"] == "drained" and report["in_flight"] == 0
            # A second /drain and SIGTERM's drain are the same drain: at once.
            drained, message = await asyncio.to_thread(request_drain, "127.0.0.1", service.metrics_port, 10.0)
            assert drained, message
            assert await asyncio.wait_for(service.drain(), 5) == 0
            assert await _probe(session, mesh, "ready") == (503, "draining")


async def test_a_drain_that_reaches_its_bound_reports_what_is_open(model_dir: Path) -> None:
    async with _metrics_mesh(model_dir, drain_seconds=0.5,
                         drain_unready_seconds=0.0) as mesh:
        service = _service(mesh)
        engine = mesh.engines["engine-a"]
        engine.answer_tokens, engine.pause_after = 1000, 2  # never ends on its own
        async with aiohttp.ClientSession() as session:
            stream = asyncio.create_task(_stream(session, mesh))
            await asyncio.wait_for(engine.paused.wait(), 20)
            drained, message = await asyncio.to_thread(request_drain, "127.0.0.1", service.metrics_port, 30.0)
            assert not drained
            assert '"status": "timeout"' in message and '"in_flight": 1' in message
            # SIGTERM next: drain_then_stop gets the open count and cuts it.
            assert await asyncio.wait_for(service.drain(), 5) == 1
            assert engine.cancels == 0  # the drain sent the engine nothing
            stream.cancel()
            await asyncio.gather(stream, return_exceptions=True)


async def test_not_ready_without_the_scheduler(model_dir: Path) -> None:
    async with _metrics_mesh(model_dir) as mesh:
        async with aiohttp.ClientSession() as session:
            await _until_probe(session, mesh, "ready", 200)
            for server in mesh.servers:  # the fake scheduler goes away
                await server.stop(0)
            await _until_probe(session, mesh, "ready", 503)
            assert await _probe(session, mesh, "ready") == (503, "no_scheduler")
            assert await _probe(session, mesh, "live") == (200, "ok")
            assert await _probe(session, mesh, "started") == (200, "ok")
