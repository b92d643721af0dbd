"""Keepalive of every hop from the mesh's `network` block: gRPC servers and
channels (services/common/grpc_server.py) and Envoy -> gateways."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from services.common.config import MeshConfig, NetworkConfig
from services.common.grpc_server import client_options, configure_keepalive, keepalive_options
from services.edge.render import render
from services.edge.topology import Topology


@pytest.fixture
def network() -> Iterator[NetworkConfig]:
    custom = NetworkConfig(keepalive_time_seconds=3, keepalive_timeout_seconds=2)
    configure_keepalive(custom)
    try:
        yield custom
    finally:
        configure_keepalive(NetworkConfig())


def test_defaults_detect_a_silent_peer_well_under_30_seconds() -> None:
    assert MeshConfig().network.detect_seconds == 10.0


def test_clients_ping_and_never_stop_pinging_on_a_long_stream(network: NetworkConfig) -> None:
    options = dict(client_options())
    assert options["grpc.keepalive_time_ms"] == 3000
    assert options["grpc.keepalive_timeout_ms"] == 2000
    # gRPC times a keepalive ping's ack with ping_timeout_ms (default 60 s).
    assert options["grpc.http2.ping_timeout_ms"] == 2000
    assert options["grpc.keepalive_permit_without_calls"] == 1
    # Default 2: a gateway reading a long stream would stop pinging after two.
    assert options["grpc.http2.max_pings_without_data"] == 0


def test_servers_permit_pings_twice_as_often_as_clients_send_them(network: NetworkConfig) -> None:
    server = dict(keepalive_options(server=True))
    assert server["grpc.http2.min_ping_interval_without_data_ms"] == 1500
    assert server["grpc.http2.min_ping_interval_without_data_ms"] < dict(client_options())["grpc.keepalive_time_ms"]


def test_envoy_keeps_gateway_connections_alive_from_the_topology() -> None:
    topology = Topology()
    topology.timeouts.upstream_keepalive_seconds = 4
    topology.timeouts.upstream_keepalive_timeout_seconds = 6
    clusters = {c["name"]: c for c in render(topology)["static_resources"]["clusters"]}
    opts = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
    grpc_cluster = next(c for c in clusters.values() if "http2_protocol_options" in str(c))
    h2 = grpc_cluster["typed_extension_protocol_options"][opts]["explicit_http_config"]["http2_protocol_options"]
    assert h2["connection_keepalive"] == {"interval": "4s", "timeout": "6s"}
    for cluster in clusters.values():
        if "upstream_connection_options" in cluster:
            assert cluster["upstream_connection_options"]["tcp_keepalive"] == {
                "keepalive_time": 4, "keepalive_interval": 2, "keepalive_probes": 3}
