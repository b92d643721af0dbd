"""The scheduler process: gRPC server (Scheduler, Admin (admin_api.py) +
health + reflection),
housekeeping timers, and on its metrics port (plain HTTP) /metrics, the
probes and /drain (services/common/health_http.py).

    service = SchedulerService(config, clock=FakeClock())
    port = await service.start(port=0)
    ...
    await service.stop()

Health turns SERVING as soon as the gRPC server is up: the scheduler can
queue requests with zero engines (they register whenever they come). The
probes: started and ready = SERVING (until stop), live = the event loop
answers. POST /drain has nothing to drain (its state is soft: gateways and
engines re-attach to the next scheduler) and answers `drained` at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path
from typing import Any

from aiohttp import web
from prometheus_client import generate_latest

from services.common.clock import Clock, SystemClock
from services.common.config import MeshConfig
from services.common.config.addresses import join_host_port
from services.common.grpc_server import make_server
from services.common.health_http import Check, HttpEndpoint, Probes, add_health_routes, add_metrics_route
from services.common.mesh_tls import add_port, identity_for
from services.common.proto.kvmesh.v1 import admin_pb2, admin_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from services.common.service_main import run_until_signalled
from services.common.tracing import tracing_for

from .admin_api import AdminKeys, AdminServicer
from .core import SchedulerCore
from .grpc_api import SchedulerServicer
from .incarnation_store import FileIncarnations, IncarnationStore
from .metrics import SchedulerMetrics

__all__ = ["SchedulerService", "incarnation_store_for", "incarnations_path", "serve"]

log = logging.getLogger(__name__)

SERVICE_NAME = scheduler_pb2.DESCRIPTOR.services_by_name["Scheduler"].full_name
ADMIN_SERVICE_NAME = admin_pb2.DESCRIPTOR.services_by_name["Admin"].full_name
# Seconds stop() lets streams flush their final messages before cancelling.
_STOP_GRACE_SECONDS = 2.0


def incarnations_path(config: MeshConfig) -> str:
    """`scheduler.incarnations_file`, or <run_dir>/scheduler-incarnations.json."""
    return config.scheduler.incarnations_file or str(Path(config.run_dir) / "scheduler-incarnations.json")


def incarnation_store_for(config: MeshConfig) -> IncarnationStore:
    """Where the scheduler process records engine incarnations: the Redis
    `scheduler.incarnations_redis_url` names, else the file."""
    url = config.scheduler.incarnations_redis_url
    if not url:
        return FileIncarnations(incarnations_path(config))
    # redis is imported only where it is used.
    from .incarnation_redis import RedisIncarnations

    return RedisIncarnations(url)


class SchedulerService:
    def __init__(self, config: MeshConfig, clock: Clock | None = None,
                 incarnations: IncarnationStore | None = None) -> None:
        """`incarnations`: where engine incarnations are recorded beyond this
        process (`serve` gives the file; None = this process's memory)."""
        self.config = config
        self.clock: Clock = clock or SystemClock()
        self.metrics = SchedulerMetrics()
        self.core = SchedulerCore(config, self.clock, self.metrics)
        # NO_TRACING unless `tracing.otlp_endpoint` is set (services/common/tracing.py).
        self.tracing = tracing_for(config.tracing, "scheduler")
        self.servicer = SchedulerServicer(self.core, config, self.clock, self.tracing, incarnations)
        self.admin_keys = AdminKeys(config.scheduler)
        self.admin = AdminServicer(self.core, self.servicer.deliver, self.admin_keys)
        self._server: Any = None
        self._health: Any = None
        self._tasks: list[asyncio.Task[None]] = []
        self._metrics_server: HttpEndpoint | None = None
        self.port = 0
        self.metrics_port = 0

    async def start(self, port: int = 0) -> int:
        """Serve on scheduler.host:`port` (0 = any free port); returns the
        bound port."""
        identity = identity_for(self.config, "scheduler")
        server, health = make_server([SERVICE_NAME, ADMIN_SERVICE_NAME], identity)
        scheduler_pb2_grpc.add_SchedulerServicer_to_server(self.servicer, server)
        admin_pb2_grpc.add_AdminServicer_to_server(self.admin, server)
        address = join_host_port(self.config.scheduler.host, port)
        bound = add_port(server, address, identity)
        if bound == 0:
            raise OSError(f"scheduler: cannot listen on {address}; is the port taken?")
        await server.start()
        self._server, self._health, self.port = server, health, bound
        await health.set_serving(True)
        s = self.config.scheduler
        self._tasks = [
            asyncio.create_task(self._every(s.tick_seconds, self.servicer.tick), name="sched-tick"),
            asyncio.create_task(
                self._every(s.queued_update_seconds, self.servicer.send_queued_updates),
                name="sched-queued-updates"),
        ]
        self.servicer.peer_watch.start()   # the other replicas' queue heads (peer_watch.py)
        if s.metrics_port:
            await self._serve_metrics(s.host, s.metrics_port)
        log.info("scheduler listening on %s:%d (policy %s; Admin service %s)", s.host, bound, s.policy,
                 f"with {len(self.admin_keys)} admin key(s)" if len(self.admin_keys) else "off: no admin key")
        return bound

    async def _serve_metrics(self, host: str, port: int) -> None:
        app = web.Application()
        add_metrics_route(app, lambda: generate_latest(self.metrics.registry))
        add_health_routes(app, Probes(ready=self._serving, started=self._serving), drain=None)
        self._metrics_server = HttpEndpoint(app)
        self.metrics_port = await self._metrics_server.start(host, port)

    def _serving(self) -> Check:
        if self._health is not None and self._health.serving:
            return Check(True, "ok", "serving")
        return Check(False, "stopping" if self._server is None else "starting", "not serving")

    @staticmethod
    async def _every(seconds: float, action: Any) -> None:
        while True:
            await asyncio.sleep(seconds)
            try:
                action()
            except Exception:  # a timer must outlive one bad pass
                log.exception("scheduler timer %s failed", getattr(action, "__name__", action))

    def drain_engine(self, engine_id: str) -> bool:
        """Send Drain to an engine and stop placing on it."""
        return self.servicer.drain_engine(engine_id)

    async def stop(self, grace: float = _STOP_GRACE_SECONDS) -> None:
        """Stop taking work, tell waiting requests DRAINING, close streams."""
        if self._server is None:
            return
        await self._health.set_serving(False)
        self.servicer.shutdown()
        await self.servicer.peer_watch.stop()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []
        await self._server.stop(grace)
        self._server = None
        if self._metrics_server is not None:
            await self._metrics_server.stop()
            self._metrics_server = None
        await self.tracing.aclose()  # exports the spans still buffered


async def serve(config: MeshConfig) -> None:
    """Run the scheduler on its configured port until cancelled or sent
    SIGTERM/SIGINT; either way it stops gracefully (waiting requests get
    DRAINING, streams close)."""
    service = SchedulerService(config, incarnations=incarnation_store_for(config))
    await run_until_signalled(
        "scheduler", lambda: service.start(config.scheduler.port), service.stop, freeze_heap=True
    )
