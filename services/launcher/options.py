"""The launcher's records: what a caller asks for on top of the config
(`MeshOptions`, from `kvmesh up` flags or a test), where the started mesh
listens (`Endpoints`), and the files of one run (`RunFiles`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["Endpoints", "MeshOptions", "RunFiles"]


@dataclass
class MeshOptions:
    """What `kvmesh up` flags (or a test) change on top of the config."""

    engines: int | None = None
    backend: str | None = None
    gateways: int = 1
    # Active scheduler replicas (README "Several schedulers"); replica r
    # listens where services/launcher/port_plan.py `scheduler_ports` says.
    schedulers: int = 1
    model: str | None = None
    # Key clients use; None = generate a dev key.
    api_key: str | None = None
    # The scheduler's admin token (kvmesh admin); None = generate one.
    admin_token: str | None = None
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
    # The batch service's internal credential for this run (set by
    # `resolve_batch`); "" = none handed over (batch off, or it reads
    # its own from the environment / batch.internal_key_file).
    batch_credential: str = ""
    # `kvmesh up --autoscale MIN:MAX`: engine ids and ports for MAX engines,
    # `engines` (default MIN) started, the rest started and drained by the
    # local actuator (autoscale.py) as the scheduler's policy asks; None = a
    # fixed fleet.
    autoscale: tuple[int, int] | None = None

    def initial_engines(self, configured: int) -> int:
        """Engines `kvmesh up` starts: all `configured`, or with autoscaling
        `engines` clamped to [MIN, MAX] (default MIN)."""
        if self.autoscale is None:
            return configured
        lo, hi = self.autoscale
        return lo if self.engines is None else min(hi, max(lo, self.engines))


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
    # The batch service's HTTP API (Envoy routes /v1/files, /v1/batches to it); "" = none.
    batch_http: str = ""
    # Every scheduler replica's gRPC address (`scheduler` is the first).
    schedulers: list[str] = field(default_factory=list)

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


@dataclass(frozen=True)
class RunFiles:
    """Where one run keeps its files: everything under `run_dir`."""

    run_dir: Path

    @property
    def log_dir(self) -> Path:
        return self.run_dir / "logs"

    @property
    def config_path(self) -> Path:
        """The resolved config every child reads."""
        return self.run_dir / "kvmesh.resolved.yaml"

    @property
    def admin_token_path(self) -> Path:
        """The run's admin token (owner-only), for `kvmesh admin --token-file`."""
        return self.run_dir / "admin-token"

    @property
    def envoy_config_path(self) -> Path:
        return self.run_dir / "envoy.yaml"

    @property
    def dev_cert_dir(self) -> Path:
        """Development certificates of Envoy's TLS listener (a local CA)."""
        return self.run_dir / "tls"

    @property
    def cache_dir(self) -> Path:
        """Scratch for vLLM's and torch's caches and sockets."""
        return self.run_dir / "cache"
