"""The engine service: gRPC `kvmesh.v1.Engine` over one backend (sim or
vLLM), its Connect link to the scheduler, vLLM-named metrics and an optional
OpenAI HTTP endpoint.

Start-up order: gRPC server up with health NOT_SERVING -> backend.start()
(model load + warm-up) -> health SERVING -> register with the scheduler
(hello reports what the started backend really has). Stop (SIGTERM) drains:
health NOT_SERVING and load reports `serving: false` (the scheduler stops
placing here), running generations finish for `stop_grace_seconds` (the
drain timeout), the rest are handed over (their streams end UNAVAILABLE and
the gateway migrates them), then the Connect stream closes (deregistered)
and everything stops.

Probes and drain (services/common/health_http.py), plain HTTP on the
metrics port: started = model loaded and warmed up; ready = serving
(registered with the scheduler, not draining, stopping or failed); live =
not failed (the backend is alive: EngineDead and liveness.py's hang bound
both end in `runtime.fail`). POST /drain (loopback only; a preStop hook)
runs the drain SIGTERM runs -- NOT_SERVING, `stop_grace_seconds` for
running generations, the rest handed over -- but leaves the process up,
registered and not serving; SIGTERM then ends it at once.

Failure (the backend died or hung: runtime.py `fail`): the live streams are
handed over at once, health turns NOT_SERVING and a load report with
`serving: false` goes out, then `serve` stops the engine and raises
ServiceFailed -- the process exits with EXIT_SERVICE_FAILED and its
supervisor (`kvmesh up`, Kubernetes) starts it again, same id and port.
"""

from __future__ import annotations

import asyncio
import logging

import grpc
from aiohttp import web

from services.common.clock import Clock, SystemClock
from services.common.config import ConfigError, EngineConfig, MeshConfig
from services.common.config.addresses import join_host_port, split_host_port
from services.common.gc_heap import freeze_startup_heap
from services.common.grpc_server import HealthReporter, make_server
from services.common.health_http import (
    Check,
    DrainReport,
    HttpEndpoint,
    OnceDrain,
    Probes,
    add_health_routes,
    add_metrics_route,
)
from services.common.mesh_tls import add_port, identity_for
from services.common.proto.kvmesh.v1 import engine_pb2_grpc
from services.common.service_main import run_until_signalled
from services.common.tracing import tracing_for
from services.engine.backend import EngineBackend, LoadSnapshot
from services.engine.coalesce import StreamPacing
from services.engine.grpc_api import EngineServicer
from services.engine.http_api import OpenAIHttpServer
from services.engine.liveness import HangPolicy
from services.engine.metrics import EngineMetrics
from services.engine.model import TextCodec, load_codec, resolve_model
from services.engine.runtime import EngineRuntime
from services.engine.scheduler_link import SchedulerLink, advertised_host
from services.engine.scheduler_links import SchedulerLinks

__all__ = ["EngineService", "make_backend", "serve"]

log = logging.getLogger(__name__)

SERVICE_NAME = "kvmesh.v1.Engine"


def make_backend(config: MeshConfig, engine: EngineConfig) -> EngineBackend:
    """The backend `engine.backend` names; vLLM is imported only when asked for."""
    if engine.backend == "sim":
        from services.engine.sim import SimBackend

        return SimBackend(config, engine)
    if engine.backend == "vllm":
        try:
            from services.engine.vllm_backend import VllmBackend
        except ImportError as exc:
            raise ConfigError(
                f"engine.backend: 'vllm' needs services.engine.vllm_backend and vLLM installed "
                f"(`pip install .[cpu]`); import failed: {exc}"
            ) from exc
        return VllmBackend(config, engine)
    raise ConfigError(f"engine.backend: unknown backend {engine.backend!r}; use 'sim' or 'vllm'")


class EngineService:
    """One engine, startable in-process: `port = await svc.start()`, `await svc.stop()`.

    `engine.port` 0 binds a free port. `engine.scheduler_address` empty =
    standalone (no Connect link).
    """

    def __init__(
        self,
        config: MeshConfig,
        engine: EngineConfig,
        backend: EngineBackend | None = None,
        clock: Clock | None = None,
        freeze_heap: bool = False,
    ) -> None:
        self.config = config
        # Freeze the start-up heap before turning SERVING (see gc_heap): the
        # process entry point only, never an engine inside a test process.
        self._freeze_heap = freeze_heap
        self.engine = engine
        self.backend = backend or make_backend(config, engine)
        self.clock = clock or SystemClock()
        self.model_name = resolve_model(config, engine).name
        self.metrics = EngineMetrics(self.model_name, engine.engine_id, self._safe_load)
        # Serving = ready (model loaded, registered, not draining or failed): read at scrape time.
        self.metrics.serving.set_function(lambda: 1.0 if self._ready().ok else 0.0)
        self.backend.set_step_observer(self.metrics)
        # NO_TRACING unless `tracing.otlp_endpoint` is set (services/common/tracing.py).
        self.tracing = tracing_for(config.tracing, "engine", engine.engine_id)
        pacing = StreamPacing(engine.coalesce_interval_ms / 1000.0, engine.coalesce_min_running,
                              frozenset(engine.coalesce_unpaced_priorities))
        hang = HangPolicy(engine.hang_floor_seconds, engine.hang_step_multiple, engine.hang_busy_multiple)
        self.runtime = EngineRuntime(self.backend, self.metrics, self.clock, pacing, hang,
                                     config.resume.grace_seconds)
        self.port = 0
        # The Connect links to every scheduler replica; `link` is the first
        # (the one scheduler of most meshes).
        self.links: SchedulerLinks | None = None
        self.link: SchedulerLink | None = None
        self._server: grpc.aio.Server | None = None
        self._servicer: EngineServicer | None = None
        self._health: HealthReporter | None = None
        self._metrics_server: HttpEndpoint | None = None
        self.metrics_port = 0
        self.drain = OnceDrain(self._drain)
        self._up = False  # start() finished: model loaded, warmed up, SERVING
        self._http: OpenAIHttpServer | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    def _safe_load(self) -> LoadSnapshot:
        return self.runtime.load()

    @property
    def address(self) -> str:
        """What the engine announces: engine.advertise_address, else the
        bound host (a wildcard one replaced by this machine's) and port."""
        if self.engine.advertise_address:
            return self.engine.advertise_address
        return join_host_port(advertised_host(self.engine.host), self.port)

    def _http_address(self) -> str:
        host = (split_host_port(self.engine.advertise_address)[0] if self.engine.advertise_address
                else advertised_host(self.engine.host))
        return join_host_port(host, self.engine.http_port)

    async def start(self) -> int:
        """Serve gRPC (NOT_SERVING), start the backend, then SERVING and
        register with the scheduler. Returns the bound gRPC port."""
        engine = self.engine
        identity = identity_for(self.config, "engine")
        server, health = make_server([SERVICE_NAME], identity)
        self._server, self._health = server, health
        await health.set_serving(False)  # an explicit NOT_SERVING, not NOT_FOUND
        self._servicer = EngineServicer(self.runtime, engine.engine_id, engine.backend, self.tracing)
        engine_pb2_grpc.add_EngineServicer_to_server(self._servicer, server)
        self.port = add_port(server, join_host_port(engine.host, engine.port), identity)
        if not self.port:
            raise OSError(f"engine.port: cannot bind {engine.host}:{engine.port}")
        await server.start()
        try:
            if engine.metrics_port:
                await self._serve_metrics(engine.host, engine.metrics_port)
            await self.runtime.start()
            http_address = ""
            if engine.http_port:
                self._http = OpenAIHttpServer(self.runtime, self._codec(), self.model_name)
                # With mesh TLS, only mesh certificates reach it: it serves
                # without the gateway's keys and limits.
                await self._http.start(engine.host, engine.http_port,
                                       identity.server_ssl_context() if identity else None)
                http_address = self._http_address()
            if self._freeze_heap:
                # Before SERVING: the one full collection (~0.3 s with vLLM
                # loaded) must not stall requests already placed here.
                freeze_startup_heap()
            if not self.drain.started:  # a preStop drain may come while the model loads
                await health.set_serving(True)
            self.runtime.add_listener(self._sync_health)
            if engine.schedulers():
                self.links = SchedulerLinks(self.config, engine, self.runtime, self.address,
                                            http_address, engine.backend)
                self.link = self.links.links[0]
                self.links.start()
        except BaseException:
            await self.stop()
            raise
        self._up = True
        log.info("engine %s (%s, model %s) serving on %s", engine.engine_id, engine.backend,
                 self.model_name, self.address)
        return self.port

    async def _serve_metrics(self, host: str, port: int) -> None:
        """/metrics, the probes and /drain: up before the model loads, so
        the probes can say `loading`."""
        app = web.Application()
        add_metrics_route(app, self.metrics.exposition)
        add_health_routes(app, Probes(self._live, self._ready, self._started), self.drain)
        speed = getattr(self.backend, "speed", None)
        if speed is not None:  # a sim engine: its run-time speed knob (sim/speed_http.py)
            from services.engine.sim.speed_http import add_speed_routes

            add_speed_routes(app, speed)
        self._metrics_server = HttpEndpoint(app)
        self.metrics_port = await self._metrics_server.start(host, port)

    def _started(self) -> Check:
        if self._up:
            return Check(True, "ok", "model loaded, warm-up done")
        return Check(False, "loading", "loading the model and warming up")

    def _live(self) -> Check:
        if self.runtime.dead is not None:
            return Check(False, "failed", self.runtime.dead)
        return Check(True, "ok", "backend alive")

    def _ready(self) -> Check:
        runtime = self.runtime
        if runtime.dead is not None:
            return Check(False, "failed", runtime.dead)
        if not self._up:
            return Check(False, "loading", "loading the model and warming up")
        if runtime.stopping or self.drain.started:
            return Check(False, "draining", "draining: new generations go to other engines")
        if runtime.draining:
            return Check(False, "draining", "drained by the scheduler: new generations go elsewhere")
        if self.links is not None and not self.links.connected():
            return Check(False, "not_registered",
                         f"not registered with any scheduler ({', '.join(self.engine.schedulers())})")
        return Check(True, "ok", "serving")

    def _codec(self) -> TextCodec:
        codec = getattr(self.backend, "codec", None)
        if codec is not None:
            return codec
        return load_codec(resolve_model(self.config, self.engine).path, self.engine.sim.vocab_size)

    async def failure(self) -> str:
        """Returns (why) once the engine failed as a whole."""
        await self.runtime.died.wait()
        return self.runtime.dead or "engine failed"

    def _sync_health(self) -> None:
        # Draining, stopping or failed: health checks (Envoy, grpcurl) see it too.
        if self._health is not None and self._health.serving and not self.runtime.serving:
            task = asyncio.get_running_loop().create_task(self._health.set_serving(False))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _drain(self) -> DrainReport:
        """NOT_SERVING, running generations finish for stop_grace_seconds,
        the rest are handed over (their gateways migrate them); the backend
        and the scheduler link stay up. Once (`self.drain`): POST /drain and
        SIGTERM share it."""
        if self._health is not None and self._health.serving:
            await self._health.set_serving(False)
        if self._servicer is not None:
            self._servicer.close_calls()
        running = self.runtime.live_count
        # A failed engine handed its generations over already: nothing to drain.
        grace = self.engine.stop_grace_seconds if running and self.runtime.dead is None else 0.0
        loop = asyncio.get_running_loop()
        began = loop.time()
        handed_over = await self.runtime.hand_off(grace)
        seconds = round(loop.time() - began, 3)
        log.info("engine %s drained in %.1f s: %d running, %d handed over", self.engine.engine_id,
                 seconds, running, handed_over)
        return DrainReport(True, "nothing runs here: finished or handed over to other engines",
                           {"running": running, "handed_over": handed_over, "seconds": seconds})

    async def stop(self) -> None:
        await self.drain()
        await self.runtime.stop(0.0)
        if self.links is not None:
            await self.links.stop()
            self.links = self.link = None
        if self._server is not None:
            await self._server.stop(grace=0.5)
            self._server = None
        for closer in (self._http, self._metrics_server):
            if closer is not None:
                await closer.stop()
        self._http = self._metrics_server = None
        await self.tracing.aclose()  # exports the spans still buffered


async def serve(config: MeshConfig, engine: EngineConfig) -> None:
    """Run one engine until cancelled or SIGTERM/SIGINT, then stop gracefully."""
    # The engine freezes its heap itself, before it turns SERVING.
    service = EngineService(config, engine, freeze_heap=True)
    await run_until_signalled("engine", service.start, service.stop, freeze_heap=False,
                              failure=service.failure)
