"""A whole kvmesh on one machine as child processes: scheduler, engines,
gateways and Envoy. Used by `kvmesh up` and by the end-to-end tests.

Structure: `Mesh` is a `Supervisor` (supervisor.py: spawn, health waits,
signals, restart, stop; one thread drives it) of the children this module
plans: resolve.py settles the config (counts, model, ports, certificates,
API key), port_plan.py owns the ports, specs.py turns the resolved config into
child specs, envoy_config.py renders Envoy's bootstrap for the run. The records
(`ChildSpec`, `Probe`, `MeshOptions`, `Endpoints`...) live in children.py and
options.py and are re-exported here, the launcher's public surface.

With `free_ports=True` every port is picked at run time, so meshes started by
concurrent test runs never collide; Envoy always gets a dynamic --base-id
unless the config names one.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from pathlib import Path
from typing import TextIO

import yaml

from services.common.config import MeshConfig
from services.launcher.autoscale import LocalAutoscaler, SchedulerView
from services.launcher.children import (
    ChildExit,
    ChildSpec,
    MeshError,
    MeshInterrupted,
    Probe,
    ProbeKind,
    RestartPolicy,
    Role,
)
from services.launcher.envoy_config import envoy_binary, load_run_topology, render_envoy, uses_dev_certs
from services.launcher.options import Endpoints, MeshOptions, RunFiles
from services.launcher.port_plan import endpoints, ports_in_use
from services.launcher.probes import scheduler_fleet
from services.launcher.resolve import front_cores, resolve_admin_token, resolve_batch, resolve_config
from services.launcher.rolling import RollStep, envoy_healthy, roll
from services.launcher.specs import child_env, child_specs
from services.launcher.supervisor import Supervisor

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
    "RollStep",
    "envoy_binary",
    "start_on_free_ports",
]

log = logging.getLogger("kvmesh.launcher")


class Mesh(Supervisor):
    """Start, watch and stop a mesh. `start()` returns once every service is
    healthy or raises MeshError; `stop_all()` is safe to call at any time."""

    def __init__(
        self,
        config: MeshConfig,
        options: MeshOptions | None = None,
        cancel: threading.Event | None = None,
    ) -> None:
        self.options = options or MeshOptions()
        self.config, self.api_key = resolve_config(config, self.options)
        self.admin_token = resolve_admin_token(self.config, self.options)
        self.files = RunFiles(Path(self.config.run_dir))
        self.run_dir = self.files.run_dir
        self.config_path = self.files.config_path
        self.envoy_config_path = self.files.envoy_config_path
        self.topology = load_run_topology(self.config, self.options.envoy)
        tls_ca = self.files.dev_cert_dir / "ca.pem" if uses_dev_certs(self.topology) else None
        self.endpoints = endpoints(self.config, self.options, tls_ca)
        self.options = dataclasses.replace(
            self.options, batch_credential=resolve_batch(self.config, self.options, self.endpoints))
        if self.options.gateways > 1 and self.config.responses.store == "embedded":
            log.warning("%d gateways, each with its own Responses store: previous_response_id finds a stored "
                        "response only on the gateway that created it (set responses.store: redis, with "
                        "gateway.response_cache.redis_url)", self.options.gateways)
        super().__init__(self.files.log_dir, cancel or threading.Event(), front_cores(self.config))

    def specs(self) -> list[ChildSpec]:
        """Every child in start order."""
        return child_specs(self.config, self.options, self.files, self.endpoints)

    def _env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        return child_env(self.options, extra)

    def _write_files(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        data = dataclasses.asdict(self.config)
        self.config_path.write_text(
            "# Written by kvmesh up: the config every child of this mesh reads.\n"
            + yaml.safe_dump(data, sort_keys=False)
        )
        token_path = self.files.admin_token_path
        token_path.touch(mode=0o600)
        token_path.chmod(0o600)
        token_path.write_text(self.admin_token + "\n")
        if self.options.envoy:
            self.envoy_config_path.write_text(
                render_envoy(self.config, self.topology, self.options.gateways, self.files.dev_cert_dir)
            )

    def start(self) -> Endpoints:
        """Start everything and wait until each service is healthy: the
        scheduler first, then engines, the batch service and gateways together, then Envoy (so
        its first health-check round finds the gateways up)."""
        if not self.options.free_ports:
            busy = ports_in_use(self.config, self.options)
            if busy:
                raise MeshError("ports already in use (stop the other mesh or change the config): "
                                + ", ".join(busy))
        self._write_files()
        specs = self.specs()
        first = set(self.engine_names()[:self.options.initial_engines(self.config.engines.count)])
        phases = [
            [s for s in specs if s.role is Role.SCHEDULER],
            [s for s in specs if s.role in (Role.BATCH, Role.GATEWAY) or s.name in first],
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

    def engine_names(self) -> list[str]:
        """Every engine this mesh may run, in index order (with --autoscale,
        MAX of them; the first `initial_engines` start with the mesh)."""
        return [s.name for s in self.specs() if s.role is Role.ENGINE]

    def autoscaler(self, out: TextIO | None = None) -> LocalAutoscaler | None:
        """The local actuator of `--autoscale` (autoscale.py), None without it."""
        if self.options.autoscale is None:
            return None
        view = SchedulerView.for_mesh(self.config, self.endpoints.scheduler, self.admin_token)
        specs = [s for s in self.specs() if s.role is Role.ENGINE]
        return LocalAutoscaler(self, view, specs, self.options.autoscale,
                               self.config.scheduler.scaling.interval_seconds, out=out)

    def rolling_restart(self, role: Role = Role.GATEWAY) -> list[RollStep]:
        """Restart every child of `role` one at a time (rolling.py): each
        gateway drains, exits, comes back, and is in Envoy's rotation again
        before the next one stops; each scheduler replica hands its queued
        requests over, exits, comes back, and has every running engine
        reporting to it again before the next. Blocks; drive it from the
        mesh's thread."""
        names = [n for n in self.names if self._child(n).spec.role is role]
        return roll(self, names, self.in_rotation, self._cancel)

    def in_rotation(self, name: str) -> bool:
        """A gateway is in rotation once Envoy's health checks pass it (its
        own probes passed already); a scheduler once every running engine
        reports to it (engines reconnect up to 2 s after it is back: until
        then the requests it owns would wait for them); anything else once
        it is healthy."""
        spec = self._child(name).spec
        if spec.role is Role.SCHEDULER:
            engines = [n for n in self.names if self._child(n).spec.role is Role.ENGINE and self.is_running(n)]
            return scheduler_fleet(spec.probes[0]) >= len(engines)
        if not name.startswith("gateway-") or not self.endpoints.envoy_port:
            return True
        r = int(name.removeprefix("gateway-"))
        http = self.endpoints.gateway_http[r].split("://", 1)[1]
        return envoy_healthy(self.endpoints.admin_port, http, self.endpoints.gateway_grpc[r])

    def __enter__(self) -> Mesh:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_all()


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
