"""The engine's probes and drain on its metrics port, in-process with the sim
backend and a fake scheduler: started/ready/live through loading, serving,
draining and failing; POST /drain hands over what outlives stop_grace and
leaves the process up; the announced address is the advertised one."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import aiohttp
import grpc
import pytest
from engine_helpers import engine_config, engine_stub, free_port, mesh_config
from grpc_health.v1 import health_pb2
from test_engine_failure import ending, health_status, open_stream, until_not_serving_reported
from test_scheduler_link import FakeScheduler, start_fake

from services.common.config import EngineConfig
from services.engine.server import EngineService
from services.engine.sim import SimBackend

ADVERTISED = "kvmesh-engine-0.kvmesh-engine.kvmesh.svc.cluster.local:50100"


class SlowStartSim(SimBackend):
    """The sim, its start (model load + warm-up) held until `loaded` is set."""

    loaded: asyncio.Event

    async def start(self) -> None:
        await self.loaded.wait()
        await super().start()


@pytest.fixture
async def scheduler() -> AsyncIterator[tuple[FakeScheduler, int]]:
    server, fake, port = await start_fake()
    try:
        yield fake, port
    finally:
        await server.stop(0)


def _engine(scheduler_port: int, **overrides: object) -> EngineConfig:
    engine = engine_config(scheduler_address=f"127.0.0.1:{scheduler_port}", metrics_port=free_port(),
                           **overrides)
    engine.sim.speed_factor = 1.0  # ~8 ms a step: a 2,000-token stream runs for seconds
    return engine


async def _probe(svc: EngineService, name: str) -> tuple[int, str]:
    url = f"http://127.0.0.1:{svc.engine.metrics_port}/health/{name}"
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        return response.status, (await response.json())["status"]


async def _probes(svc: EngineService) -> dict[str, tuple[int, str]]:
    return {name: await _probe(svc, name) for name in ("started", "ready", "live")}


async def _until(svc: EngineService, name: str, code: int, timeout: float = 30.0) -> None:
    async with asyncio.timeout(timeout):
        while True:
            with contextlib.suppress(aiohttp.ClientConnectionError):
                if (await _probe(svc, name))[0] == code:
                    return
            await asyncio.sleep(0.02)


async def _drain(svc: EngineService) -> tuple[int, dict[str, object]]:
    url = f"http://127.0.0.1:{svc.engine.metrics_port}/drain"
    async with aiohttp.ClientSession() as session, session.post(url) as response:
        return response.status, await response.json()


async def test_loading_serving_draining_drained(scheduler: tuple[FakeScheduler, int]) -> None:
    fake, port = scheduler
    engine = _engine(port, stop_grace_seconds=0.5, advertise_address=ADVERTISED, engine_id="kvmesh-engine-0")
    backend = SlowStartSim(mesh_config(), engine)
    backend.loaded = asyncio.Event()
    svc = EngineService(mesh_config(), engine, backend=backend)
    starting = asyncio.create_task(svc.start())
    try:
        await _until(svc, "live", 200)
        # Loading: alive, neither started nor ready (the kubelet waits, never restarts).
        assert await _probes(svc) == {"started": (503, "loading"), "ready": (503, "loading"), "live": (200, "ok")}
        backend.loaded.set()
        await asyncio.wait_for(starting, 30)
        hello = (await fake.next("hello")).hello
        assert hello.engine_id == "kvmesh-engine-0" and hello.address == ADVERTISED
        await _until(svc, "ready", 200)
        assert await _probes(svc) == {"started": (200, "ok"), "ready": (200, "ok"), "live": (200, "ok")}

        async with engine_stub(svc) as stub:
            long = await open_stream(stub, "long", max_tokens=2000)
            drain = asyncio.create_task(_drain(svc))
            await _until(svc, "ready", 503)
            assert await _probe(svc, "ready") == (503, "draining")
            assert await _probe(svc, "live") == (200, "ok")
            assert await health_status(svc) == health_pb2.HealthCheckResponse.NOT_SERVING
            status, report = await asyncio.wait_for(drain, 30)
            # The stream outlived stop_grace_seconds: handed over (the gateway migrates it).
            assert status == 200
            assert report["status"] == "drained" and report["running"] == 1 and report["handed_over"] == 1
            code, details, _ = await ending(long)
            assert code == grpc.StatusCode.UNAVAILABLE and "drain timeout" in details
            # Drained, not stopped: the process is up, not ready, not restarted.
            assert await _probes(svc) == {"started": (200, "ok"), "ready": (503, "draining"), "live": (200, "ok")}
            await asyncio.wait_for(until_not_serving_reported(fake), 10)  # the scheduler places elsewhere
            assert svc.runtime.started and svc._server is not None
            # Asked again (a retried preStop): the same drain, at once.
            assert await asyncio.wait_for(_drain(svc), 5) == (status, report)
    finally:
        backend.loaded.set()
        with contextlib.suppress(BaseException):
            await starting
        await asyncio.wait_for(svc.stop(), 10)  # SIGTERM after the drain: nothing left to wait for


async def test_a_stream_that_ends_within_the_grace_is_not_handed_over(scheduler: tuple[FakeScheduler, int]) -> None:
    _, port = scheduler
    svc = EngineService(mesh_config(), _engine(port, stop_grace_seconds=60.0))
    await svc.start()
    try:
        async with engine_stub(svc) as stub:
            short = await open_stream(stub, "short", max_tokens=40)
            status, report = await asyncio.wait_for(_drain(svc), 60)
            assert status == 200 and report["running"] == 1 and report["handed_over"] == 0
            assert (await ending(short))[0] == grpc.StatusCode.OK
    finally:
        await svc.stop()


async def test_a_failed_engine_is_not_live(scheduler: tuple[FakeScheduler, int]) -> None:
    _, port = scheduler
    svc = EngineService(mesh_config(), _engine(port))
    await svc.start()
    try:
        await _until(svc, "ready", 200)
        svc.backend.crash("test: the core process was killed")  # type: ignore[attr-defined]  # svc.backend is the sim backend: its crash() is a test hook
        await asyncio.wait_for(svc.runtime.died.wait(), 10)
        assert await _probe(svc, "live") == (503, "failed")
        assert await _probe(svc, "ready") == (503, "failed")
        url = f"http://127.0.0.1:{svc.engine.metrics_port}/health/live"
        async with aiohttp.ClientSession() as session, session.get(url) as response:
            assert "the core process was killed" in (await response.json())["reason"]
    finally:
        await svc.stop()


async def test_not_ready_while_not_registered_with_the_scheduler() -> None:
    svc = EngineService(mesh_config(), _engine(free_port()))  # nothing listens there
    await svc.start()
    try:
        assert await _probe(svc, "started") == (200, "ok")
        assert await _probe(svc, "ready") == (503, "not_registered")
        assert await _probe(svc, "live") == (200, "ok")
    finally:
        await svc.stop()


async def test_a_drain_while_loading_keeps_the_engine_out_of_service(scheduler: tuple[FakeScheduler, int]) -> None:
    _, port = scheduler
    engine = _engine(port)
    backend = SlowStartSim(mesh_config(), engine)
    backend.loaded = asyncio.Event()
    svc = EngineService(mesh_config(), engine, backend=backend)
    starting = asyncio.create_task(svc.start())
    try:
        await _until(svc, "live", 200)
        status, report = await asyncio.wait_for(_drain(svc), 10)  # the pod is deleted while it loads
        assert status == 200 and report["status"] == "drained" and report["running"] == 0
        backend.loaded.set()
        await asyncio.wait_for(starting, 30)
        assert await _probes(svc) == {"started": (200, "ok"), "ready": (503, "draining"), "live": (200, "ok")}
        assert await health_status(svc) == health_pb2.HealthCheckResponse.NOT_SERVING
    finally:
        backend.loaded.set()
        with contextlib.suppress(BaseException):
            await starting
        await asyncio.wait_for(svc.stop(), 10)
