"""The child specs of one mesh, in start order: the scheduler, one engine per
configured engine, the batch service (when `batch.enabled`), the gateway
replicas, then Envoy. Every kvmesh child runs
`python -m services.cli --config <resolved config>` with its role, a clean
offline environment and health probes over mesh TLS when it is on."""

from __future__ import annotations

import os
import sys

from services.batch.credential import CREDENTIAL_ENV
from services.common.config import MeshConfig
from services.common.config.addresses import join_host_port
from services.common.mesh_tls import MeshIdentity, identity_for
from services.launcher.children import DEFAULT_STOP_GRACE_SECONDS, ChildSpec, Probe, ProbeKind, RestartPolicy, Role
from services.launcher.envoy_config import envoy_binary
from services.launcher.options import Endpoints, MeshOptions, RunFiles
from services.launcher.port_plan import gateway_ports, scheduler_ports

__all__ = ["child_env", "child_specs"]

# Seconds a service may take to become healthy. vLLM imports for ~15 s and
# loads a model for ~30 s on two cores, but two engines starting together on a
# busy machine took 5.5 min here; everything else takes a few seconds,
# more on a noisy machine.
_START_TIMEOUT = {"scheduler": 60.0, "gateway": 90.0, "batch": 60.0, "sim": 90.0, "vllm": 900.0, "envoy": 60.0}


def child_env(options: MeshOptions, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The launcher's environment for a child: offline Hugging Face,
    unbuffered output, the caller's extra variables; never KVMESH_CONFIG (the
    child gets the resolved config by flag)."""
    env = dict(os.environ)
    env.pop("KVMESH_CONFIG", None)
    env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"})
    env.update(options.env)
    env.update(extra or {})
    return env


def child_specs(cfg: MeshConfig, options: MeshOptions, files: RunFiles, endpoints: Endpoints) -> list[ChildSpec]:
    """Every child in start order."""
    plan = _Planner(cfg, options, files)
    me = identity_for(cfg, "admin")
    specs = [plan.scheduler(r, me) for r in range(options.schedulers)]
    specs += [plan.engine(i, me) for i in range(cfg.engines.count)]
    if cfg.batch.enabled:
        specs.append(plan.batch(endpoints))
    specs += [plan.gateway(r, me, endpoints) for r in range(options.gateways)]
    if options.envoy:
        specs.append(plan.envoy(endpoints))
    return specs


class _Planner:
    """Builds one spec per role from the resolved config."""

    def __init__(self, cfg: MeshConfig, options: MeshOptions, files: RunFiles) -> None:
        self.cfg = cfg
        self.options = options
        self.files = files

    def _kvmesh(self, *args: str) -> list[str]:
        level = os.environ.get("KVMESH_LOG_LEVEL", "INFO")
        return [sys.executable, "-m", "services.cli", "--config", str(self.files.config_path),
                "--log-level", level, *args]

    def _timeout(self, key: str) -> float:
        return self.options.start_timeout or _START_TIMEOUT[key]

    def scheduler(self, r: int, me: MeshIdentity | None) -> ChildSpec:
        """Scheduler replica `r` ("scheduler", then "scheduler-1", ...)."""
        grpc_port, metrics = scheduler_ports(self.cfg, r)
        return ChildSpec(
            name=f"scheduler-{r}" if r else "scheduler", role=Role.SCHEDULER,
            argv=self._kvmesh("scheduler", "--port", str(grpc_port), "--metrics-port", str(metrics)),
            probes=[Probe(ProbeKind.GRPC_HEALTH, join_host_port(self.cfg.scheduler.host, grpc_port), identity=me,
                          server_role="scheduler")],
            env=child_env(self.options), start_timeout=self._timeout("scheduler"),
            # Soft state: engines re-register, gateways re-admit and re-attach.
            restart=RestartPolicy.ALWAYS,
        )

    def engine(self, i: int, me: MeshIdentity | None) -> ChildSpec:
        engine = self.cfg.engine_config(i)
        extra: dict[str, str] = {}
        if engine.backend == "vllm":
            # vLLM and torch write caches and sockets; keep them in our scratch dir.
            cache = self.files.cache_dir
            extra = {"VLLM_CACHE_ROOT": str(cache / "vllm"),
                     "TORCHINDUCTOR_CACHE_DIR": str(cache / "torchinductor"),
                     "TMPDIR": str(cache / "tmp")}
        return ChildSpec(
            name=engine.engine_id, role=Role.ENGINE, argv=self._kvmesh("engine", "--index", str(i)),
            probes=[Probe(ProbeKind.GRPC_HEALTH, f"{engine.host}:{engine.port}", identity=me,
                          server_role="engine")],
            env=child_env(self.options, extra), start_timeout=self._timeout(engine.backend),
            # An engine whose backend died or hung hands its streams over and
            # exits 3; it restarts empty, with the same id and port.
            restart=RestartPolicy.ALWAYS,
        )

    def gateway(self, r: int, me: MeshIdentity | None, endpoints: Endpoints) -> ChildSpec:
        http, grpc_port, metrics = gateway_ports(self.cfg, r)
        host = self.cfg.gateway.host
        return ChildSpec(
            name=f"gateway-{r}", role=Role.GATEWAY,
            argv=self._kvmesh("gateway", "--replica", str(r), "--http-port", str(http),
                              "--grpc-port", str(grpc_port), "--metrics-port", str(metrics)),
            probes=[Probe(ProbeKind.GRPC_HEALTH, f"{host}:{grpc_port}", identity=me, server_role="gateway"),
                    Probe(ProbeKind.HTTP_OK, f"{endpoints.gateway_http[r]}/health", identity=me,
                          server_role="gateway")],
            env=child_env(self.options), start_timeout=self._timeout("gateway"),
            # SIGTERM drains it for up to its drain bound; then it exits by itself.
            stop_grace=self.cfg.gateway.drain_bound_seconds + DEFAULT_STOP_GRACE_SECONDS,
            # Stateless but for its streams (they resume through another
            # gateway): a dead one is restarted like the others. A drain we
            # asked for (rolling restart, stop) is expected, not restarted.
            restart=RestartPolicy.ALWAYS,
        )

    def batch(self, endpoints: Endpoints) -> ChildSpec:
        extra = {CREDENTIAL_ENV: self.options.batch_credential} if self.options.batch_credential else {}
        return ChildSpec(
            name="batch", role=Role.BATCH, argv=self._kvmesh("batch"),
            probes=[Probe(ProbeKind.HTTP_OK, f"{endpoints.batch_http}/health")],
            env=child_env(self.options, extra), start_timeout=self._timeout("batch"),
            # Its state is its database: a restart resumes every batch (README "Batch API").
            restart=RestartPolicy.ALWAYS,
            stop_grace=self.cfg.batch.drain_seconds + DEFAULT_STOP_GRACE_SECONDS,
        )

    def envoy(self, endpoints: Endpoints) -> ChildSpec:
        cfg = self.cfg
        base_id = (["--base-id", str(cfg.envoy.base_id)] if cfg.envoy.base_id
                   else ["--use-dynamic-base-id"])
        return ChildSpec(
            name="envoy", role=Role.ENVOY,
            argv=[envoy_binary(), "-c", str(self.files.envoy_config_path), *base_id,
                  "--log-level", "warning"],
            probes=[Probe(ProbeKind.HTTP_OK, f"http://127.0.0.1:{cfg.envoy.admin_port}/ready"),
                    Probe(ProbeKind.HTTP_OK, f"{endpoints.public_http}/healthz",
                          ca=str(endpoints.tls_ca or ""))],
            env=child_env(self.options), start_timeout=self._timeout("envoy"),
        )
