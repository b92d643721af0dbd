"""Where an operator tool finds the mesh: the scheduler's address (flag,
else the config's scheduler host and port) and a channel to it, mutual TLS
with the mesh's `admin` certificate when the config turns mesh TLS on (as
the launcher's own probes do)."""

from __future__ import annotations

import grpc

from services.common.config import MeshConfig
from services.common.config.addresses import join_host_port
from services.common.grpc_server import client_options
from services.common.mesh_tls import identity_for, sync_channel

__all__ = ["scheduler_address", "scheduler_channel"]


def scheduler_address(config: MeshConfig, flag: str | None) -> str:
    """`--scheduler HOST:PORT`, else where the config's scheduler listens
    (a wildcard bind host is reached on loopback)."""
    if flag:
        return flag
    host = config.scheduler.host
    if host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1"
    return join_host_port(host, config.scheduler.port)


def scheduler_channel(config: MeshConfig, address: str) -> grpc.Channel:
    return sync_channel(address, identity_for(config, "admin"), "scheduler", client_options())
