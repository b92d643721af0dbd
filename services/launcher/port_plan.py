"""The mesh's ports: picked at run time (`free_ports`), or the configured
ones checked before anything starts; gateway replica r listens on each
gateway base port + r, engine i on each engine base port + i, scheduler
replica r on scheduler.port + r (gRPC: 50051, 50052, ... below the gateway's
50061) and scheduler.metrics_port - r (9101, 9100, ...: the gateway's metrics
port is 9102)."""

from __future__ import annotations

from pathlib import Path

from services.common.config import MeshConfig
from services.common.config.addresses import join_host_port
from services.launcher.options import Endpoints, MeshOptions
from services.launcher.ports import PortAllocator, port_is_free

__all__ = ["endpoints", "gateway_ports", "pick_free_ports", "ports_in_use", "scheduler_addresses", "scheduler_ports"]


def pick_free_ports(cfg: MeshConfig, gateways: int, schedulers: int = 1) -> None:
    """Every port of `cfg` replaced by a free one; a port turned off (0) stays off."""
    ports = PortAllocator()
    n = cfg.engines.count
    cfg.scheduler.port = ports.block(schedulers)
    # Replica r's metrics port is metrics_port - r: the block's top.
    cfg.scheduler.metrics_port = ports.block(schedulers) + schedulers - 1 if cfg.scheduler.metrics_port else 0
    cfg.engines.base_port = ports.block(n)
    if cfg.engines.metrics_base_port:
        cfg.engines.metrics_base_port = ports.block(n)
    if cfg.engines.http_base_port:
        cfg.engines.http_base_port = ports.block(n)
    cfg.gateway.http_port = ports.block(gateways)
    cfg.gateway.grpc_port = ports.block(gateways)
    if cfg.gateway.metrics_port:
        cfg.gateway.metrics_port = ports.block(gateways)
    cfg.batch.port = ports.one()
    cfg.batch.metrics_port = ports.one() if cfg.batch.metrics_port else 0
    cfg.envoy.port = ports.one()
    cfg.envoy.admin_port = ports.one()


def scheduler_ports(cfg: MeshConfig, replica: int) -> tuple[int, int]:
    """(gRPC, metrics) ports of one scheduler replica; metrics 0 = off."""
    s = cfg.scheduler
    return s.port + replica, (s.metrics_port - replica if s.metrics_port else 0)


def scheduler_addresses(cfg: MeshConfig, schedulers: int) -> list[str]:
    """Where gateways and engines dial the scheduler replicas this mesh starts."""
    return [join_host_port(cfg.scheduler.host, scheduler_ports(cfg, r)[0]) for r in range(schedulers)]


def gateway_ports(cfg: MeshConfig, replica: int) -> tuple[int, int, int]:
    """(HTTP, gRPC, metrics) ports of one gateway replica; metrics 0 = off."""
    gw = cfg.gateway
    metrics = gw.metrics_port + replica if gw.metrics_port else 0
    return gw.http_port + replica, gw.grpc_port + replica, metrics


def endpoints(cfg: MeshConfig, options: MeshOptions, tls_ca: Path | None) -> Endpoints:
    host = cfg.gateway.host
    gateways = [gateway_ports(cfg, r) for r in range(options.gateways)]
    return Endpoints(
        envoy_port=cfg.envoy.port if options.envoy else 0,
        admin_port=cfg.envoy.admin_port if options.envoy else 0,
        scheduler=cfg.gateway.scheduler_address,
        engines=[
            f"{e.host}:{e.port}" for e in (cfg.engine_config(i) for i in range(cfg.engines.count))
        ],
        gateway_http=[f"{'https' if cfg.mesh_tls.enabled else 'http'}://{host}:{h}" for h, _, _ in gateways],
        gateway_grpc=[f"{host}:{g}" for _, g, _ in gateways],
        tls_ca=tls_ca,
        batch_http=f"http://{join_host_port(cfg.batch.host, cfg.batch.port)}" if cfg.batch.enabled else "",
        schedulers=scheduler_addresses(cfg, options.schedulers),
    )


def ports_in_use(cfg: MeshConfig, options: MeshOptions) -> list[str]:
    """Configured ports something else already holds, named by setting."""
    wanted: list[tuple[str, int]] = []
    for r in range(options.schedulers):
        grpc_port, metrics = scheduler_ports(cfg, r)
        wanted += [(f"scheduler.port+{r}", grpc_port), (f"scheduler.metrics_port-{r}", metrics)]
    for i in range(cfg.engines.count):
        e = cfg.engine_config(i)
        wanted += [(f"engines.base_port+{i}", e.port), (f"engines.metrics_base_port+{i}", e.metrics_port),
                   (f"engines.http_base_port+{i}", e.http_port)]
    for r in range(options.gateways):
        h, g, m = gateway_ports(cfg, r)
        wanted += [(f"gateway.http_port+{r}", h), (f"gateway.grpc_port+{r}", g),
                   (f"gateway.metrics_port+{r}", m)]
    if cfg.batch.enabled:
        wanted += [("batch.port", cfg.batch.port), ("batch.metrics_port", cfg.batch.metrics_port)]
    if options.envoy:
        wanted += [("envoy.port", cfg.envoy.port), ("envoy.admin_port", cfg.envoy.admin_port)]
    return [f"{name}={port}" for name, port in wanted if port and not port_is_free(port)]
