"""The gateway service: OpenAI HTTP/SSE + gRPC `kvmesh.v1.Inference` in front
of the scheduler and the engines. Stateless; run N replicas behind Envoy.

    service = GatewayService(config, replica=0)
    http_port, grpc_port = await service.start(http_port=0, grpc_port=0)
    ...
    await service.stop()

Health (gRPC health service and GET /health) follows the scheduler channel:
SERVING only while it is READY -- and never again once draining.

Probes and drain (services/common/health_http.py), plain HTTP on the
metrics port: started = listening; ready = SERVING above (scheduler channel
READY, not draining); live = the event loop answers. POST /drain (loopback
only; a preStop hook) runs the drain SIGTERM runs, without exiting, and
answers when nothing is in flight or at `drain_seconds`; SIGTERM after it
cuts what is still open at once and stops.

SIGTERM drains (`serve` -> `drain()`, drain.py): not ready at once, serving
on until the load balancer has noticed and in-flight streams have finished,
at most `gateway.drain_seconds`; streams still open then are cut without
cancelling their generations (the process ends like a crash), so their
clients resume elsewhere. `stop()` alone (in-process users) cancels what
is still running.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import ssl

import grpc
from aiohttp import web

from services.common.clock import Clock, SystemClock
from services.common.config import MeshConfig
from services.common.config.addresses import join_host_port
from services.common.grpc_server import HealthReporter, make_server
from services.common.health_http import Check, DrainReport, OnceDrain, Probes, listening_socket
from services.common.mesh_tls import add_port, identity_for
from services.common.proto.kvmesh.v1 import inference_pb2_grpc
from services.common.service_main import run_until_signalled
from services.common.tracing import tracing_for
from services.gateway.drain import Drain, DrainSettings
from services.gateway.driver import DriverSettings, GenerationDriver
from services.gateway.engine_client import EnginePool
from services.gateway.frontdoor import Frontdoor
from services.gateway.grpc_api import InferenceApi
from services.gateway.http_api import HttpApi
from services.gateway.keys import KeyStore
from services.gateway.limits import RateLimiter
from services.gateway.metrics import GatewayMetrics, metrics_app
from services.gateway.pipeline import RequestPipeline
from services.gateway.response_cache import build_response_cache
from services.gateway.scheduler_replicas import SchedulerReplicas
from services.gateway.served_models import ServedModels
from services.gateway.tokenization import TokenizerRegistry
from services.gateway.transport_parts import TransportParts

__all__ = ["GatewayService", "serve"]

log = logging.getLogger(__name__)

SERVICE_NAME = "kvmesh.v1.Inference"
# Through Envoy a burst of hundreds of streams arrives at once; aiohttp's
# default backlog of 128 drops connections (measured, DESIGN.md).
LISTEN_BACKLOG = 4096
# Kernel send buffer per client connection (accepted sockets inherit it from
# the listener). Linux autotunes it up to tcp_wmem's max (4 MB here), which
# would park ~25k single-token SSE chunks for a slow reader; capped, a slow
# reader stalls the relay early and the engine coalesces the rest instead
# (DESIGN: backpressure by coalescing). 64 KiB (the kernel doubles it) still
# moves far more than any token stream needs at loopback/LAN round trips.
SEND_BUFFER_BYTES = 64 * 1024
# Seconds in-flight requests get to finish on `stop()` before they are
# cancelled (after a drain nothing is left in flight).
STOP_GRACE_SECONDS = 5.0


class GatewayService:
    def __init__(self, config: MeshConfig, replica: int = 0, clock: Clock | None = None) -> None:
        self.config = config
        self.replica = replica
        gw = config.gateway
        self.metrics = GatewayMetrics(replica)
        # NO_TRACING unless `tracing.otlp_endpoint` is set (services/common/tracing.py).
        self.tracing = tracing_for(config.tracing, "gateway", f"gateway-{replica}")
        self.tokenizers = TokenizerRegistry(config.models)
        self.clock = clock or SystemClock()
        # One response cache for both transports (services/gateway/response_cache/).
        self.response_cache = build_response_cache(config, self.metrics.registry, self.clock,
                                                   self.tokenizers.model_dirs)
        self.frontdoor = Frontdoor(config, KeyStore(gw), RateLimiter(self.clock), self.tokenizers, self.clock,
                                   self.tracing, self.response_cache)
        self._scheduler: SchedulerReplicas | None = None
        self._engines: EnginePool | None = None
        self._grpc: grpc.aio.Server | None = None
        self._runners: list[web.AppRunner] = []
        self._health_task: asyncio.Task[None] | None = None
        self._health: HealthReporter | None = None
        self.drain_state = Drain(DrainSettings.from_config(gw), self.metrics)
        self._drain_once = OnceDrain(self._run_drain)
        self.metrics_port = 0
        self._up = False

    async def start(self, http_port: int | None = None, grpc_port: int | None = None) -> tuple[int, int]:
        """Bind and serve; ports default to the config's (0 = any free port)."""
        gw = self.config.gateway
        http_port = gw.http_port if http_port is None else http_port
        grpc_port = gw.grpc_port if grpc_port is None else grpc_port
        identity = identity_for(self.config, "gateway")
        self._scheduler = SchedulerReplicas(gw.schedulers(), identity, self.clock,
                                            self.config.network.silent_peer_seconds)
        self._scheduler.start()
        self._engines = EnginePool(identity)
        driver = GenerationDriver(
            self._scheduler,
            self._engines,
            DriverSettings(max_migrations=gw.max_migrations, heartbeat_seconds=gw.heartbeat_seconds,
                           exclude_failed_seconds=self.config.network.detect_seconds
                           + self.config.scheduler.stale_report_seconds),
            self.metrics,
            self.clock,
        )

        server, health = make_server([SERVICE_NAME], identity)
        # One cached view of the served models for both transports.
        served = ServedModels(functools.partial(self._scheduler.get_state, 1.0), self.clock)
        self.response_cache.attach_fleet(served.current)   # the engines' model revisions
        # The one request path for every transport (pipeline.py), and what else they share.
        parts = TransportParts(RequestPipeline(self.frontdoor, driver, self.metrics), self._scheduler, self.metrics,
                               served)
        inference_pb2_grpc.add_InferenceServicer_to_server(
            InferenceApi(parts), server
        )
        bound_grpc = add_port(server, join_host_port(gw.host, grpc_port), identity)
        if bound_grpc == 0:
            raise OSError(f"gateway: cannot bind gRPC port {gw.host}:{grpc_port}")
        await server.start()
        self._grpc = server

        app = HttpApi(self.config, parts).app()
        # Inside the error middleware, so a draining /health is an OpenAI 503.
        app.middlewares.append(self.drain_state.health_middleware)
        # With mesh TLS the API port is Envoy's upstream: TLS, mesh certificates only.
        bound_http = await self._serve_http(app, gw.host, http_port,
                                            identity.server_ssl_context() if identity else None)
        if gw.metrics_port:
            probes = Probes(started=self._started, ready=self._ready)
            self.metrics_port = await self._serve_http(
                metrics_app(self.metrics, probes, self._drain_once), gw.host, gw.metrics_port)

        self._health = health
        self._health_task = asyncio.create_task(self._follow_scheduler(health))
        self._up = True
        log.info(
            "gateway %d: http %s:%d grpc %s:%d scheduler %s",
            self.replica, gw.host, bound_http, gw.host, bound_grpc, ", ".join(gw.schedulers()),
        )
        return bound_http, bound_grpc

    async def _serve_http(
        self, app: web.Application, host: str, port: int, ssl_context: ssl.SSLContext | None = None
    ) -> int:
        # handler_cancellation: a client that disconnects cancels its handler
        # within milliseconds (not at the next write), so its engine work stops.
        runner = web.AppRunner(
            app, handler_cancellation=True, access_log=None, shutdown_timeout=STOP_GRACE_SECONDS
        )
        await runner.setup()
        self._runners.append(runner)
        # "::" takes IPv4 peers too.
        sock = listening_socket(host, port, LISTEN_BACKLOG, send_buffer=SEND_BUFFER_BYTES)
        site = web.SockSite(runner, sock, backlog=LISTEN_BACKLOG, ssl_context=ssl_context)
        await site.start()
        return sock.getsockname()[1]

    def _started(self) -> Check:
        return Check(True, "ok", "listening") if self._up else Check(False, "starting", "binding ports")

    def _ready(self) -> Check:
        if self.drain_state.draining:
            return Check(False, "draining", "draining: the load balancer takes this gateway out")
        if self._health is None or not self._health.serving:
            return Check(False, "no_scheduler",
                         f"no scheduler channel ({', '.join(self.config.gateway.schedulers())}) is ready")
        return Check(True, "ok", "serving")

    async def _follow_scheduler(self, health: HealthReporter) -> None:
        """SERVING exactly while a scheduler replica's channel is READY."""
        scheduler = self._scheduler
        if scheduler is None:
            return
        ready = scheduler.is_ready()
        while True:
            await health.set_serving(ready)
            ready = await scheduler.wait_ready_change(ready)

    async def _stop_following(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health_task
            self._health_task = None

    async def _not_ready(self) -> None:
        """Health NOT_SERVING for good (the drain's first step)."""
        await self._stop_following()
        if self._health is not None:
            await self._health.set_serving(False)

    async def drain(self) -> int:
        """The drain (drain.py), while everything keeps serving; returns the
        requests still in flight (0 = drained) once it ended -- at once
        when it ended before (POST /drain then SIGTERM: one drain). Nothing
        to do for a service that never started."""
        await self._drain_once()
        return self.metrics.active_streams.count

    async def _run_drain(self) -> DrainReport:
        loop = asyncio.get_running_loop()
        began = loop.time()
        open_streams = await self.drain_state.run(self._not_ready) if self._health is not None else 0
        details: dict[str, float | int | str] = {"in_flight": open_streams,
                                                 "seconds": round(loop.time() - began, 3)}
        if open_streams:
            return DrainReport(False, f"{open_streams} request(s) still in flight at the drain bound "
                               f"(gateway.drain_bound_seconds); SIGTERM cuts them and their clients resume "
                               f"elsewhere", details)
        return DrainReport(True, "nothing in flight", details)

    async def drain_then_stop(self) -> None:
        """SIGTERM: drain, cut what outlived the bound (ends the process), stop."""
        open_streams = await self.drain()
        if open_streams:
            self.drain_state.cut(open_streams)
        await self.stop()

    async def stop(self, grace: float = STOP_GRACE_SECONDS) -> None:
        await self._stop_following()
        if self._grpc is not None:
            await self._grpc.stop(grace)
            self._grpc = None
        for runner in reversed(self._runners):
            await runner.cleanup()
        self._runners.clear()
        if self._engines is not None:
            await self._engines.close()
            self._engines = None
        if self._scheduler is not None:
            await self._scheduler.close()
            self._scheduler = None
        await self.response_cache.aclose()
        await self.tracing.aclose()  # exports the spans still buffered


async def serve(config: MeshConfig, replica: int = 0) -> None:
    """Run one gateway replica until SIGTERM/SIGINT (or cancelled), then
    drain and stop."""
    service = GatewayService(config, replica)
    await run_until_signalled("gateway", service.start, service.drain_then_stop, freeze_heap=True)
