"""The scheduler's metrics port (plain HTTP, aiohttp in its event loop):
/metrics, the probes, and a /drain with nothing to drain."""

from __future__ import annotations

import socket

import aiohttp

from services.scheduler.server import SchedulerService

from .helpers import make_config


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def test_probes_metrics_and_drain_on_the_metrics_port() -> None:
    service = SchedulerService(make_config(metrics_port=_free_port()))
    await service.start(port=0)
    base = f"http://127.0.0.1:{service.metrics_port}"
    try:
        async with aiohttp.ClientSession() as session:
            for name in ("started", "ready", "live"):
                async with session.get(f"{base}/health/{name}") as response:
                    assert response.status == 200
                    assert (await response.json())["status"] == "ok"
            async with session.get(f"{base}/metrics") as response:
                assert response.status == 200 and "kvmesh_scheduler" in await response.text()
            async with session.post(f"{base}/drain") as response:
                assert response.status == 200
                assert (await response.json())["status"] == "drained"
            async with session.get(f"{base}/health/ready") as response:
                assert response.status == 200  # nothing drained: it serves until SIGTERM
    finally:
        await service.stop(grace=0.1)
