"""A gRPC server with what every kvmesh service serves besides its own API:
the standard health service (grpc.health.v1) and reflection, so grpcurl and
Envoy's health checks work against any service, directly or through Envoy.

Health starts NOT_SERVING; each service flips it to SERVING only once it can
really serve (engine: model loaded and warmed up; gateway: scheduler reached).

Keepalive (silent partitions): every server and every channel of a process
pings a silent peer after `network.keepalive_time_seconds` and drops the
connection when the ack has not come `keepalive_timeout_seconds` later, so a
peer that vanished without a reset ends its streams within their sum. Each
service process calls `configure_keepalive` once with its config (cli.py);
the defaults are the config's.
"""

from __future__ import annotations

from collections.abc import Iterable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.common.config import NetworkConfig
from services.common.grpc_guard import RejectUndecodable
from services.common.mesh_tls import MeshIdentity, RequirePeerRoles

__all__ = ["HealthReporter", "client_options", "configure_keepalive", "keepalive_options", "make_server"]

# Bounded message size keeps a rogue client from making a service allocate
# without limit; 64 MiB fits any prompt of a 1M-token context as token ids.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024

# This process's keepalive settings (`configure_keepalive`).
_process = {"network": NetworkConfig()}


def configure_keepalive(network: NetworkConfig) -> None:
    """Use `network`'s keepalive for every server and channel made from now on."""
    _process["network"] = network


def keepalive_options(server: bool) -> list[tuple[str, int]]:
    """gRPC keepalive channel arguments of a server or a client (channel)."""
    network = _process["network"]
    options = [
        ("grpc.keepalive_time_ms", int(network.keepalive_time_seconds * 1000)),
        ("grpc.keepalive_timeout_ms", int(network.keepalive_timeout_seconds * 1000)),
        # grpcio 1.85 times every ping's ack with this (default 60 s), the
        # keepalive ping's too: without it a SIGSTOPped peer was noticed
        # after ~65 s, not 10 s (measured).
        ("grpc.http2.ping_timeout_ms", int(network.keepalive_timeout_seconds * 1000)),
        ("grpc.keepalive_permit_without_calls", 1),
        # Default 2: after two pings with no DATA frame sent, gRPC throttles
        # pings (one a minute) -- a gateway reading a long stream sends
        # nothing after its request: a peer stopped 25 s into such a stream
        # was noticed after 50 s instead of 10 s (measured).
        ("grpc.http2.max_pings_without_data", 0),
    ]
    if server:
        # Accept a client's pings every keepalive_time / 2 (a client pinging
        # faster than a server permits is sent GOAWAY "too_many_pings").
        permit_ms = int(network.keepalive_time_seconds * 500)
        options.append(("grpc.http2.min_ping_interval_without_data_ms", permit_ms))
    return options


class HealthReporter:
    """Sets the serving status of the overall server ("") and of each named
    service together, so a health check on either answers the same."""

    def __init__(self, servicer: health.aio.HealthServicer, names: Iterable[str]) -> None:
        self._servicer = servicer
        self._names = ["", *names]
        self.serving = False

    async def set_serving(self, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        self.serving = serving
        for name in self._names:
            await self._servicer.set(name, status)


def make_server(
    service_names: Iterable[str], identity: MeshIdentity | None = None
) -> tuple[grpc.aio.Server, HealthReporter]:
    """A grpc.aio server with health (NOT_SERVING until told) and reflection.

    `service_names` are full names ("kvmesh.v1.Engine") of the services the
    caller will add; the caller adds them and binds ports (`mesh_tls.add_port`).
    With a mesh TLS `identity`, each call's certificate role is checked
    against `mesh_tls.METHOD_ROLES` before the handler runs.
    """
    names = list(service_names)
    # A request that is not the method's protobuf -> INVALID_ARGUMENT (not UNKNOWN).
    interceptors: list[grpc.aio.ServerInterceptor] = [RejectUndecodable()]
    if identity is not None:
        interceptors.insert(0, RequirePeerRoles())
    server = grpc.aio.server(
        interceptors=interceptors,
        options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            # Keepalive lets a peer that vanished (SIGKILL, cable) be noticed,
            # ending its streams and so releasing its leases and engines.
            *keepalive_options(server=True),
            # gRPC binds with SO_REUSEPORT by default: a second server on a
            # port already in use would start "fine" and the kernel would
            # split connections between the two. A taken port must fail.
            ("grpc.so_reuseport", 0),
        ]
    )
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    reflection.enable_server_reflection(
        [*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server
    )
    return server, HealthReporter(servicer, names)


def client_options() -> list[tuple[str, int]]:
    """Channel options matching the server's limits and keepalive."""
    return [
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        *keepalive_options(server=False),
    ]
