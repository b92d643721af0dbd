"""Envoy's Kubernetes mode: gateways named by a headless Service's DNS name
become a strict-DNS cluster (every resolved address a health-checked
gateway), and `render --all` keeps deploy/base/envoy/ in step."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path
from typing import Any

import pytest

from services.edge import render as render_mod
from services.edge.render import ENVOY_DIR, GRPC_CLUSTER, HTTP_CLUSTER, main, render
from services.edge.topology import DnsSpec, GatewayEndpoint, Topology, TopologyError, load_topology


def _clusters(topology: Topology) -> list[dict[str, Any]]:
    """The two gateway clusters (not the stats listener's loopback admin one)."""
    return [c for c in render(topology)["static_resources"]["clusters"] if c["name"] in (GRPC_CLUSTER, HTTP_CLUSTER)]


def test_a_dns_name_gives_a_strict_dns_cluster_with_health_checks() -> None:
    topology = load_topology(ENVOY_DIR / "topology-kubernetes.yaml")
    assert len(_clusters(topology)) == 2
    for cluster in _clusters(topology):
        assert "type" not in cluster
        dns = cluster["cluster_type"]["typed_config"]
        assert cluster["cluster_type"]["name"] == "envoy.clusters.dns"
        assert dns["respect_dns_ttl"] is True and dns["dns_refresh_rate"] == "5s"
        assert dns["all_addresses_in_single_endpoint"] is False
        assert dns["dns_failure_refresh_rate"] == {"base_interval": "1s", "max_interval": "5s"}
        assert cluster["health_checks"] and cluster["close_connections_on_host_health_failure"]
        (endpoint,) = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]
        assert endpoint["endpoint"]["address"]["socket_address"]["address"] == "kvmesh-gateway.kvmesh.svc.cluster.local"
        assert cluster["transport_socket"]["typed_config"]["sni"] == "gateway.kvmesh.internal"
    listener = render(topology)["static_resources"]["listeners"][0]["address"]["socket_address"]
    assert (listener["address"], listener["port_value"]) == ("0.0.0.0", 8080)
    admin = render(topology)["admin"]["address"]["socket_address"]
    assert admin["address"] == "127.0.0.1"


def test_ip_addresses_stay_a_static_cluster() -> None:
    topology = Topology(gateways=[GatewayEndpoint("10.0.0.1"), GatewayEndpoint("10.0.0.2")])
    for cluster in _clusters(topology):
        assert cluster["type"] == "STATIC" and "cluster_type" not in cluster


@pytest.mark.parametrize("dns, error", [
    (DnsSpec(refresh_seconds=0), "refresh_seconds"),
    (DnsSpec(lookup_family="V5"), "lookup_family"),
])
def test_dns_settings_are_checked(dns: DnsSpec, error: str) -> None:
    with pytest.raises(TopologyError, match=error):
        dataclasses.replace(Topology(), dns=dns).validate()


def test_check_reports_a_stale_deploy_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    copy = tmp_path / "envoy"
    shutil.copytree(render_mod.DEPLOY_ENVOY_DIR, copy)
    monkeypatch.setattr(render_mod, "DEPLOY_ENVOY_DIR", copy)
    assert main(["render", "--all", "--check"]) == 0
    (copy / "web" / "chat.js").write_text("stale")
    assert main(["render", "--all", "--check"]) == 1
    assert "chat.js (copy of web/chat.js)" in capsys.readouterr().err
    assert (copy / "web" / "chat.js").read_text() == "stale"
