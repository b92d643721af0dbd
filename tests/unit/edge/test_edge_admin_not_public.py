"""The scheduler's Admin service (kvmesh.v1.Admin) is never reachable through
Envoy's public listener: in every checked-in rendering the first route an
Admin call matches answers it in Envoy (404, gRPC UNIMPLEMENTED), no route
or cluster leads to the scheduler, and the transcoder maps only the public
Inference service."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from services.edge.render import ENVOY_DIR

ROOT = Path(__file__).resolve().parents[3]
RENDERINGS = [*sorted((ENVOY_DIR / "rendered").glob("*.yaml")), ROOT / "deploy" / "base" / "envoy" / "envoy.yaml"]
ADMIN_METHODS = ["DrainEngine", "UndrainEngine", "PauseClass", "ResumeClass", "SetPlacementPolicy",
                 "GetAdminState"]


def _hcm(config: dict[str, Any]) -> dict[str, Any]:
    for listener in config["static_resources"]["listeners"]:
        for chain in listener["filter_chains"]:
            for f in chain["filters"]:
                if f["name"] == "envoy.filters.network.http_connection_manager":
                    return f["typed_config"]
    raise AssertionError("no HTTP connection manager")


def _matches(match: dict[str, Any], path: str, headers: dict[str, str]) -> bool:
    if "path" in match and path != match["path"]:
        return False
    if "prefix" in match and not path.startswith(match["prefix"]):
        return False
    for header in match.get("headers", []):
        value = headers.get(header["name"])
        wanted = header.get("string_match", {}).get("prefix")
        if value is None or (wanted is not None and not value.startswith(wanted)):
            return False
    return "path" in match or "prefix" in match


def _first_route(config: dict[str, Any], path: str, headers: dict[str, str]) -> dict[str, Any]:
    for host in _hcm(config)["route_config"]["virtual_hosts"]:
        for route in host["routes"]:
            if _matches(route["match"], path, headers):
                return route
    raise AssertionError(f"no route for {path}")


def test_there_are_renderings() -> None:
    assert len(RENDERINGS) >= 2 and all(p.is_file() for p in RENDERINGS)


@pytest.mark.parametrize("path", RENDERINGS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_admin_calls_are_answered_by_envoy_never_forwarded(path: Path) -> None:
    config = yaml.safe_load(path.read_text())
    for method in ADMIN_METHODS:
        for headers in ({"content-type": "application/grpc"}, {"content-type": "application/json"}, {}):
            route = _first_route(config, f"/kvmesh.v1.Admin/{method}", headers)
            assert "route" not in route, (method, headers, route["name"])
            assert route["direct_response"]["status"] == 404
    # The public API still goes to the gateways (the matcher is not vacuous).
    assert "route" in _first_route(config, "/kvmesh.v1.Inference/Chat", {"content-type": "application/grpc"})
    clusters = {c["name"] for c in config["static_resources"]["clusters"]}
    assert all("scheduler" not in name for name in clusters), clusters
    for f in _hcm(config)["http_filters"]:
        services = f.get("typed_config", {}).get("services")
        if services is not None:
            assert services == ["kvmesh.v1.Inference"]
