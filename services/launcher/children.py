"""What the launcher starts: one `ChildSpec` per child process (its argv,
environment, health probes, start-up timeout and restart policy), the records
a supervisor reports, and the launcher's errors.

Records only; `port_plan.py` and `resolve.py` decide ports and config, `specs.py` builds the specs,
`supervisor.py` runs them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from pathlib import Path

from services.common.mesh_tls import MeshIdentity

__all__ = [
    "DEFAULT_STOP_GRACE_SECONDS",
    "ChildExit",
    "ChildSpec",
    "MeshError",
    "MeshInterrupted",
    "Probe",
    "ProbeKind",
    "RestartPolicy",
    "Role",
]


# Seconds between SIGTERM and SIGKILL when stopping a child: above the
# engine's drain timeout (engines.template.stop_grace_seconds, 2 s) and the
# scheduler's stream flush; a gateway's spec adds its own drain bound.
DEFAULT_STOP_GRACE_SECONDS = 10.0


class MeshError(RuntimeError):
    """A child could not start, died, or never became healthy. The message
    names the service, its log file and the log's last lines."""


class MeshInterrupted(MeshError):
    """Start-up was interrupted (Ctrl-C / SIGTERM)."""


class Role(enum.Enum):
    SCHEDULER = "scheduler"
    ENGINE = "engine"
    GATEWAY = "gateway"
    BATCH = "batch"
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
    # SIGTERM -> SIGKILL when stopping it; must exceed its own drain bound.
    stop_grace: float = DEFAULT_STOP_GRACE_SECONDS


@dataclass
class ChildExit:
    name: str
    pid: int
    returncode: int
    log_path: Path
