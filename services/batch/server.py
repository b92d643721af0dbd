"""The batch service, `kvmesh batch`: the Files + Batches HTTP API on
`batch.port` and the runner that sends each batch line through a
gateway's HTTP API (`batch.gateway_url`), its state in one SQLite file only
it writes (`batch.database`). One process per mesh.

    service = BatchService(config, credential)
    port = await service.start()
    ...
    await service.drain_then_stop()

Probes and drain (services/common/health_http.py), plain HTTP on
`batch.metrics_port`: started = listening; ready = serving and not
draining; live = the event loop answers. SIGTERM or POST /drain: start no
more lines, give those in flight up to `batch.drain_seconds`, then stop.
Lines still running then are cut; the gateways keep a batch line's
generation `resume.grace_seconds` after its connection drops, and the next
process resumes it under its recorded request id.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
from pathlib import Path

from aiohttp import web
from prometheus_client import generate_latest

from services.batch.batch_run import RunDeps
from services.batch.callers import Callers
from services.batch.credential import internal_credential
from services.batch.gate import Gate
from services.batch.http_app import batch_app
from services.batch.metrics import BatchMetrics
from services.batch.pacing import Window
from services.batch.runner import BatchRunner
from services.batch.store import Database
from services.batch.submit import LineExecutor, MeshTls
from services.common import health_http
from services.common.clock import Clock, SystemClock
from services.common.config import MeshConfig
from services.common.config.addresses import join_host_port
from services.common.health_http import Check, DrainReport, HttpEndpoint, OnceDrain
from services.common.mesh_tls import identity_for, server_name
from services.common.service_main import run_until_signalled

__all__ = ["BatchService", "database_path", "gateway_url", "serve"]

log = logging.getLogger(__name__)


def database_path(config: MeshConfig) -> str:
    """`batch.database`, or <run_dir>/batch.sqlite3."""
    return config.batch.database or str(Path(config.run_dir) / "batch.sqlite3")


def gateway_url(config: MeshConfig) -> str:
    """`batch.gateway_url`, or the first gateway of this config."""
    gw = config.gateway
    scheme = "https" if config.mesh_tls.enabled else "http"
    return config.batch.gateway_url or f"{scheme}://{join_host_port(gw.host, gw.http_port)}"


def _mesh_tls(config: MeshConfig) -> MeshTls | None:
    """With mesh TLS, an https gateway URL is a gateway's own port: the
    batch service presents the mesh's admin identity (an operator's tool
    of the mesh; there is no batch role) and checks the gateway's name."""
    identity = identity_for(config, "admin") if gateway_url(config).startswith("https://") else None
    return MeshTls(identity.client_ssl_context(), server_name("gateway")) if identity else None


class BatchService:
    def __init__(self, config: MeshConfig, credential: str, clock: Clock | None = None) -> None:
        self.config = config
        settings = config.batch
        self.clock = clock or SystemClock()
        self.metrics = BatchMetrics()
        self.db = Database(database_path(config))
        self.callers = Callers(config)
        self.gate = Gate(Window(settings.max_in_flight), self.clock)
        self._executor = LineExecutor(gateway_url(config), credential, _mesh_tls(config))
        deps = RunDeps(settings, self.db, self._executor, self.gate, self.metrics, self.clock)
        self.runner = BatchRunner(deps, self.callers,
                                  f"{socket.gethostname()}/pid-{os.getpid()}/{secrets.token_hex(3)}")
        self._api = HttpEndpoint(batch_app(config, self.callers, self.db, self.clock, self._serving))
        self._drain_once = OnceDrain(self._run_drain)
        admin = web.Application()
        health_http.add_metrics_route(admin, lambda: generate_latest(self.metrics.registry))
        health_http.add_health_routes(admin, health_http.Probes(started=self._started, ready=self._ready),
                                      self._drain_once)
        self._admin = HttpEndpoint(admin)
        self.port = self.metrics_port = 0
        self._up = False

    async def start(self, port: int | None = None, metrics_port: int | None = None) -> int:
        """Bind and run; ports default to the config's (API 0 = any free
        port; metrics 0 = off)."""
        settings = self.config.batch
        self.port = await self._api.start(settings.host, settings.port if port is None else port)
        metrics_port = settings.metrics_port if metrics_port is None else metrics_port
        if metrics_port:
            self.metrics_port = await self._admin.start(settings.host, metrics_port)
        self.runner.start()
        self._up = True
        log.info("batch: http %s:%d, lines to %s, database %s", settings.host, self.port,
                 gateway_url(self.config), database_path(self.config))
        return self.port

    def _serving(self) -> bool:
        return not self._drain_once.started

    def _started(self) -> Check:
        return Check(True, "ok", "listening") if self._up else Check(False, "starting", "binding ports")

    def _ready(self) -> Check:
        if not self._serving():
            return Check(False, "draining", "draining: no new lines")
        return self._started()

    async def drain(self) -> DrainReport:
        return await self._drain_once()

    async def _run_drain(self) -> DrainReport:
        """No new lines; those in flight get `batch.drain_seconds`."""
        self.gate.close()
        loop = asyncio.get_running_loop()
        began = loop.time()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.config.batch.drain_seconds):
                await self.gate.emptied()
        left = self.gate.in_flight
        details: dict[str, float | int | str] = {"in_flight": left, "seconds": round(loop.time() - began, 3)}
        if left:
            return DrainReport(False, f"{left} line(s) still running at batch.drain_seconds: they are cut at "
                               "the stop and resumed by the next batch process", details)
        return DrainReport(True, "no line in flight", details)

    async def drain_then_stop(self) -> None:
        await self.drain()
        await self.stop()

    async def stop(self) -> None:
        self.gate.close()
        await self.runner.stop()
        await self._executor.close()
        await self._api.stop()
        await self._admin.stop()
        self.db.close()


async def serve(config: MeshConfig) -> None:
    """Run the batch service until SIGTERM/SIGINT (or cancelled), then
    drain and stop. ConfigError before anything binds when its internal
    credential is missing or wrong."""
    service = BatchService(config, internal_credential(config.batch))
    await run_until_signalled("batch", service.start, service.drain_then_stop, freeze_heap=True)
