"""A listener that serves Envoy's Prometheus stats and nothing else, so a
Prometheus outside the pod can scrape Envoy while the admin interface stays
on loopback (it can reconfigure and stop Envoy: /quitquitquit, /logging,
/runtime_modify, /drain_listeners ...).

The usual Envoy pattern: an HTTP listener on its own port whose only route,
`GET /stats/prometheus` (exact path, after path normalisation; a query
string such as `?usedonly` passes, the admin handler only reads it), goes to
a static cluster pointing at the loopback admin address. Every other path
and method is answered 404 by Envoy itself. Its connection manager's stat
prefix is `stats`, so scrapes are not counted as public (`edge`) traffic.

Off by default (`stats.port: 0`): `kvmesh up`'s Prometheus scrapes the admin
port on loopback directly. envoy/topology-kubernetes.yaml turns it on for
the PodMonitor of deploy/overlays/monitoring.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from services.edge.fragments import TYPE, socket_address

__all__ = ["ADMIN_CLUSTER", "STATS_PATH", "StatsSpec", "admin_cluster", "stats_listener"]

ADMIN_CLUSTER = "envoy_admin"
STATS_PATH = "/stats/prometheus"

_HCM = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
_ROUTER = "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"


@dataclass
class StatsSpec:
    """The stats-only listener: `port` 0 = none (the default)."""

    # 0.0.0.0 in a pod (Prometheus scrapes the pod's address); the
    # NetworkPolicy lets only the namespace `monitoring` reach the port.
    host: str = "127.0.0.1"
    # 9902: next to the admin port 9901. 0 = no stats listener. 0-65535.
    port: int = 0

    @property
    def enabled(self) -> bool:
        return self.port != 0

    def validate(self, taken: dict[str, int]) -> str | None:
        """The problem with this spec, or None; `taken`: setting -> port of
        the other listeners it must not collide with."""
        if not 0 <= self.port <= 65535:
            return f"stats.port: {self.port} is not a TCP port (0 = off, 1-65535)"
        for where, port in taken.items():
            if self.enabled and self.port == port:
                return f"stats.port: {self.port} is already {where}"
        return None


def stats_listener(spec: StatsSpec) -> dict[str, Any]:
    """The listener: one route to the admin's /stats/prometheus, 404 otherwise."""
    manager = {
        TYPE: _HCM,
        "stat_prefix": "stats",
        "codec_type": "AUTO",
        # Match (and forward) the normalised path: no `/stats/prometheus/../x`.
        "normalize_path": True,
        "merge_slashes": True,
        "path_with_escaped_slashes_action": "REJECT_REQUEST",
        "route_config": {
            "name": "stats",
            "virtual_hosts": [{"name": "stats", "domains": ["*"], "routes": [
                {
                    "name": "prometheus",
                    "match": {"path": STATS_PATH,
                              "headers": [{"name": ":method", "string_match": {"exact": "GET"}}]},
                    "route": {"cluster": ADMIN_CLUSTER, "timeout": "10s"},
                },
                {
                    "name": "not_stats",
                    "match": {"prefix": "/"},
                    "direct_response": {"status": 404, "body": {
                        "inline_string": f"only GET {STATS_PATH} is served here\n"}},
                },
            ]}],
        },
        "http_filters": [{"name": "envoy.filters.http.router", "typed_config": {TYPE: _ROUTER}}],
    }
    return {
        "name": "stats",
        "address": socket_address(spec.host, spec.port),
        "filter_chains": [{"filters": [
            {"name": "envoy.filters.network.http_connection_manager", "typed_config": manager}]}],
    }


def admin_cluster(admin_host: str, admin_port: int) -> dict[str, Any]:
    """The loopback admin interface as the stats route's upstream."""
    return {
        "name": ADMIN_CLUSTER,
        "type": "STATIC",
        "connect_timeout": "1s",
        "load_assignment": {
            "cluster_name": ADMIN_CLUSTER,
            "endpoints": [{"lb_endpoints": [{"endpoint": {"address": socket_address(admin_host, admin_port)}}]}],
        },
    }
