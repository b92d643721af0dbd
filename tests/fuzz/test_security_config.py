"""Security defaults that need no running mesh: every service but Envoy
binds to loopback by default, and Envoy's public listener forwards only the
public gRPC API (kvmesh.v1.Inference), health and reflection -- never the
internal kvmesh.v1.Scheduler / kvmesh.v1.Engine services."""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Any

import pytest

from services.common.config import EngineConfig, MeshConfig, load_config
from services.edge.render import GRPC_CLUSTER, PUBLIC_GRPC_PREFIXES, render
from services.edge.topology import Topology, load_topology

ROOT = Path(__file__).resolve().parents[2]
TOPOLOGIES = sorted((ROOT / "envoy").glob("topology*.yaml"))


def _loopback(host: str) -> bool:
    return host == "localhost" or ipaddress.ip_address(host).is_loopback


@pytest.mark.parametrize("config", [MeshConfig(), load_config(ROOT / "config" / "kvmesh.yaml")],
                         ids=["dataclass-defaults", "config/kvmesh.yaml"])
def test_services_bind_to_loopback_by_default(config: MeshConfig) -> None:
    hosts = {
        "scheduler.host": config.scheduler.host,
        "gateway.host": config.gateway.host,
        "engines.template.host": config.engines.template.host,
        "engine_config(0).host": config.engine_config(0).host,
        "EngineConfig().host": EngineConfig().host,
        # Envoy is the one service meant to face clients; even it starts on loopback.
        "envoy.listen_host": config.envoy.listen_host,
    }
    assert {k: v for k, v in hosts.items() if not _loopback(v)} == {}
    assert _loopback(config.gateway.scheduler_address.rsplit(":", 1)[0])


def _routes(config: dict[str, Any]) -> list[dict[str, Any]]:
    listener = config["static_resources"]["listeners"][0]
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    return hcm["route_config"]["virtual_hosts"][0]["routes"]


def _first_match(routes: list[dict[str, Any]], path: str, headers: dict[str, str]) -> dict[str, Any]:
    """Envoy's route selection for what these routes use: prefix / path
    plus header prefix or exact matches, first match wins."""
    for route in routes:
        match = route["match"]
        if "path" in match and match["path"] != path:
            continue
        if "prefix" in match and not path.startswith(match["prefix"]):
            continue
        ok = True
        for h in match.get("headers", []):
            value = headers.get(h["name"])
            sm = h.get("string_match", {})
            if value is None or ("prefix" in sm and not value.startswith(sm["prefix"])) or (
                    "exact" in sm and value != sm["exact"]):
                ok = False
        if ok:
            return route
    raise AssertionError(f"no route for {path}")


GRPC = {"content-type": "application/grpc", ":method": "POST"}
INTERNAL = ["/kvmesh.v1.Scheduler/Admit", "/kvmesh.v1.Scheduler/AdmitMany", "/kvmesh.v1.Scheduler/Connect",
            "/kvmesh.v1.Scheduler/GetState",
            "/kvmesh.v1.Engine/Generate", "/kvmesh.v1.Engine/Abort", "/kvmesh.v1.Engine/GetInfo",
            "/some.other.Service/Method"]
PUBLIC = ["/kvmesh.v1.Inference/Chat", "/kvmesh.v1.Inference/Generate", "/kvmesh.v1.Inference/ListModels",
          "/grpc.health.v1.Health/Check", "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"]


@pytest.mark.parametrize("topology_path", TOPOLOGIES, ids=lambda p: p.name)
def test_public_listener_forwards_only_public_grpc(topology_path: Path) -> None:
    routes = _routes(render(load_topology(topology_path)))
    for route in routes:
        if route.get("route", {}).get("cluster") == GRPC_CLUSTER:
            assert route["match"].get("prefix") in PUBLIC_GRPC_PREFIXES, route
    for path in INTERNAL:
        for headers in (GRPC, {"content-type": "application/json", ":method": "POST"}):
            if not path.startswith("/kvmesh.v1.") and headers is not GRPC:
                continue
            chosen = _first_match(routes, path, headers)
            assert "direct_response" in chosen, (path, chosen["name"])
            assert chosen["direct_response"]["status"] == 404
    for path in PUBLIC:
        assert _first_match(routes, path, GRPC)["route"]["cluster"] == GRPC_CLUSTER, path


def test_admin_and_upstreams_are_loopback_in_the_default_topology() -> None:
    topology = load_topology(ROOT / "envoy" / "topology.yaml")
    assert _loopback(topology.admin.host)
    assert all(_loopback(g.host) for g in topology.gateways)
    assert isinstance(render(Topology()), dict)
