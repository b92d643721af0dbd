"""The config a mesh's children read: the caller's config with everything
settled (counts, model, ports, absolute paths, mesh TLS certificates, the
API key), and the cores the mesh's front processes may use.

Pure planning: nothing here starts a process; `resolve_config` only writes
development mesh certificates when mesh TLS is on without certificates of
the operator's own.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import secrets
from pathlib import Path

from services.batch.credential import CREDENTIAL_ENV
from services.common.affinity import omp_cores
from services.common.config import AdminKeyConfig, ApiKeyConfig, ConfigError, MeshConfig, config_from_dict
from services.common.mesh_tls import ROLES, MeshIdentity, mesh_cert_dir
from services.launcher.options import Endpoints, MeshOptions
from services.launcher.port_plan import pick_free_ports, scheduler_addresses
from services.tools.devcerts import ensure_mesh_certs

__all__ = ["ROOT", "absolute", "front_cores", "resolve_admin_token", "resolve_batch", "resolve_config"]

ROOT = Path(__file__).resolve().parents[2]
# Scheduler replicas `kvmesh up` starts at most (port_plan.scheduler_ports).
_MAX_SCHEDULERS = 10


def absolute(path: str) -> Path:
    """A config path: relative ones are relative to the repository root."""
    p = Path(path)
    return p if p.is_absolute() else ROOT / p


def resolve_config(config: MeshConfig, opts: MeshOptions) -> tuple[MeshConfig, str]:
    """A copy of `config` with everything the children need settled, and the
    API key clients use (the caller's, or a generated dev key)."""
    cfg = config_from_dict(MeshConfig, dataclasses.asdict(config), "config")
    if opts.run_dir is not None:
        cfg.run_dir = str(opts.run_dir)
    cfg.run_dir = str(absolute(cfg.run_dir))
    for model in cfg.models:
        model.path = str(absolute(model.path))
    _apply_counts_and_model(cfg, opts)
    if opts.free_ports:
        pick_free_ports(cfg, opts.gateways, opts.schedulers)
    # Gateways and engines both dial the scheduler replicas this mesh starts.
    cfg.gateway.scheduler_address = f"{cfg.scheduler.host}:{cfg.scheduler.port}"
    cfg.engines.template.scheduler_address = cfg.gateway.scheduler_address
    replicas = scheduler_addresses(cfg, opts.schedulers) if opts.schedulers > 1 else []
    cfg.gateway.scheduler_addresses = list(replicas)
    cfg.engines.template.scheduler_addresses = list(replicas)
    cfg.scheduler.peers.addresses = list(replicas)   # the replicas hear each other's queue heads
    if opts.mesh_tls:
        cfg.mesh_tls.enabled = True
    if cfg.mesh_tls.enabled:
        _settle_mesh_certs(cfg)
    api_key = opts.api_key or secrets.token_urlsafe(24)
    digest = hashlib.sha256(api_key.encode()).hexdigest()
    if not any(k.sha256 == digest for k in cfg.gateway.api_keys):
        cfg.gateway.api_keys.append(ApiKeyConfig(sha256=digest, tenant="dev", priority_ceiling=0))
    return cfg, api_key


def resolve_admin_token(cfg: MeshConfig, opts: MeshOptions) -> str:
    """The admin token of this run (the caller's, or generated), added to
    `cfg.scheduler.admin_keys` as held by "kvmesh-up"."""
    token = opts.admin_token or secrets.token_urlsafe(24)
    digest = hashlib.sha256(token.encode()).hexdigest()
    if not any(k.sha256.strip().lower() == digest for k in cfg.scheduler.admin_keys):
        cfg.scheduler.admin_keys.append(AdminKeyConfig(sha256=digest, name="kvmesh-up"))
    return token


def resolve_batch(cfg: MeshConfig, opts: MeshOptions, endpoints: Endpoints) -> str:
    """The batch service's settings for this run, in `cfg.batch`: where its
    lines go (unless configured: Envoy's listener when it is plaintext, so a
    dead gateway is routed around; else gateway 0) and the internal
    credential's hash. Returns the credential to hand the batch child: the
    caller's ($KVMESH_BATCH_INTERNAL_KEY), or one made for the run when the
    config names none; "" when the batch service reads its own
    (batch.internal_key_file) or is off."""
    batch = cfg.batch
    if not batch.enabled:
        return ""
    if not batch.gateway_url:
        plain_envoy = endpoints.envoy_port and endpoints.tls_ca is None
        batch.gateway_url = endpoints.public_http if plain_envoy else endpoints.gateway_http[0]
    given = opts.env.get(CREDENTIAL_ENV) or os.environ.get(CREDENTIAL_ENV, "")
    if batch.internal_key_sha256:
        return given   # the batch service checks it against the hash itself
    credential = given or secrets.token_urlsafe(32)
    batch.internal_key_sha256 = hashlib.sha256(credential.encode()).hexdigest()
    return credential


def _apply_counts_and_model(cfg: MeshConfig, opts: MeshOptions) -> None:
    """Engine and gateway counts, backend and served model from the options."""
    if opts.autoscale is not None:
        lo, hi = opts.autoscale
        if not 0 <= lo <= hi or hi < 1:
            raise ConfigError(f"--autoscale: need 0 <= MIN <= MAX and MAX >= 1, got {lo}:{hi}")
        cfg.engines.count = hi   # ids and ports for every engine the actuator may start
        scaling = cfg.scheduler.scaling
        scaling.enabled, scaling.min_engines, scaling.max_engines = True, lo, hi
    elif opts.engines is not None:
        if opts.engines < 1:
            raise ConfigError("--engines: must be >= 1")
        cfg.engines.count = opts.engines
    if opts.gateways < 1:
        raise ConfigError("--gateways: must be >= 1")
    if not 1 <= opts.schedulers <= _MAX_SCHEDULERS:
        # Replica r listens on scheduler.port + r: 50051 .. 50060 below the gateway's 50061.
        raise ConfigError(f"--schedulers: must be within 1 .. {_MAX_SCHEDULERS}, got {opts.schedulers}")
    if opts.backend:
        if opts.backend not in ("sim", "vllm"):
            raise ConfigError(f"--backend: {opts.backend!r} is not one of ['sim', 'vllm']")
        cfg.engines.backend = "sim" if opts.backend == "sim" else "vllm"
    model_name = opts.model or cfg.engines.template.model or (cfg.models[0].name if cfg.models else "")
    if not model_name:
        raise ConfigError("models: the config lists no model to serve")
    model = cfg.model(model_name)
    if not Path(model.path).is_dir():
        raise ConfigError(
            f"models.{model_name}.path: {model.path} does not exist; run `make setup` to build it"
        )
    cfg.engines.template.model = model_name


def _settle_mesh_certs(cfg: MeshConfig) -> None:
    """Every child reads its certificate from `mesh_tls.cert_dir` (the
    written config): development certificates unless the operator gave a
    folder, and a missing file fails here, not in a child."""
    folder = mesh_cert_dir(cfg)
    if not cfg.mesh_tls.cert_dir:
        ensure_mesh_certs(folder)
    cfg.mesh_tls.cert_dir = str(folder)
    for role in ROLES:
        MeshIdentity.load(folder, role)


def front_cores(cfg: MeshConfig) -> set[int]:
    """Cores for Envoy, the gateways, the scheduler and the engine services
    when this host's vLLM engines pin their own processes: every core this
    launcher may use except vLLM's. Left to the kernel, their threads also
    land on vLLM's core, where the engine core busy-polls: the mesh added
    5.2 ms to vLLM's own first-token time so, 2.8 ms pinned (BENCHMARKS.md,
    the comparison of kvmesh with vLLM's own server). Empty = leave them to
    the kernel."""
    if not hasattr(os, "sched_getaffinity"):
        return set()
    vllm_cores: set[int] = set()
    for i in range(cfg.engines.count):
        engine = cfg.engine_config(i)
        if engine.backend != "vllm" or not engine.vllm.pin_vllm_processes:
            continue
        try:
            vllm_cores |= omp_cores(engine.vllm.omp_threads_bind)
        except ValueError:  # "auto" or another non-list: vLLM decides, so do not guess
            return set()
    return set(os.sched_getaffinity(0)) - vllm_cores if vllm_cores else set()
