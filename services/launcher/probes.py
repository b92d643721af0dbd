"""Health probes the supervisor polls while a child starts: gRPC health
(`grpc.health.v1`, over mesh TLS when the probe carries an identity) or an
HTTP GET that must answer 200."""

from __future__ import annotations

import ssl
import urllib.error
import urllib.request

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.mesh_tls import sync_channel
from services.common.proto.kvmesh.v1 import scheduler_pb2, scheduler_pb2_grpc
from services.launcher.children import Probe, ProbeKind

__all__ = ["probe_ok", "scheduler_fleet"]

# Short reconnect backoff: the default grows to minutes, which would notice a
# slow starter (vLLM) long after it is up.
_PROBE_CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


def probe_ok(probe: Probe, channels: dict[str, grpc.Channel]) -> bool:
    """One probe attempt; `channels` caches gRPC channels by target across
    attempts (the caller closes them)."""
    if probe.kind is ProbeKind.GRPC_HEALTH:
        return _grpc_serving(probe, channels)
    return _http_ok(probe)


def _grpc_serving(probe: Probe, channels: dict[str, grpc.Channel]) -> bool:
    channel = channels.get(probe.target)
    if channel is None:
        channel = channels[probe.target] = sync_channel(
            probe.target, probe.identity, probe.server_role, list(_PROBE_CHANNEL_OPTIONS)
        )
    try:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=2.0
        )
    except grpc.RpcError:
        return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def scheduler_fleet(probe: Probe) -> int:
    """How many engines the scheduler behind `probe` (its gRPC health probe)
    lists with a fresh report -- engines that reconnected to it after its
    restart, so it can place on them; -1 while it cannot be asked."""
    with sync_channel(probe.target, probe.identity, probe.server_role, list(_PROBE_CHANNEL_OPTIONS)) as channel:
        try:
            state = scheduler_pb2_grpc.SchedulerStub(channel).GetState(scheduler_pb2.GetStateRequest(), timeout=2.0)
        except grpc.RpcError:
            return -1
    return sum(1 for e in state.engines if e.fresh)


def _http_ok(probe: Probe) -> bool:
    context = ssl.create_default_context(cafile=probe.ca) if probe.ca else None
    if probe.identity is not None:
        context = probe.identity.client_ssl_context()
        # urllib checks the URL's host (an IP) against the certificate, which
        # names the role; the chain is still verified against the mesh CA.
        context.check_hostname = False
    try:
        with urllib.request.urlopen(probe.target, timeout=2.0, context=context) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False
