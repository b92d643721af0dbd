"""The two upstream clusters over every gateway replica: gRPC (HTTP/2) and
HTTP (HTTP/1.1, as aiohttp cannot be an HTTP/2 upstream); and the batch
service's (`batch_cluster`).
Least-request balancing, active health checks, outlier detection on
connection-level failures only, circuit breakers far above one machine's
load, and mutual TLS to the gateways when the mesh runs TLS.
"""

from __future__ import annotations

import ipaddress
import math
from typing import Any

from services.edge.fragments import BATCH_CLUSTER, TYPE, seconds, socket_address
from services.edge.topology import GatewayEndpoint, Topology

__all__ = ["batch_cluster", "cluster"]


_HTTP_OPTIONS = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
# Linux's <netinet/tcp.h>: Envoy takes socket options as raw numbers.
_IPPROTO_TCP = 6
_TCP_USER_TIMEOUT = 18


def cluster(topology: Topology, name: str, grpc: bool) -> dict[str, Any]:
    """The gateways' gRPC (`grpc=True`, HTTP/2) or HTTP (HTTP/1.1) ports as
    one load-balanced, health-checked cluster."""
    gateways: list[GatewayEndpoint] = topology.gateways
    endpoints = [
        {"endpoint": {"address": socket_address(gw.host, gw.grpc_port if grpc else gw.http_port)}}
        for gw in gateways
    ]
    if grpc:
        protocol: dict[str, Any] = {
            "http2_protocol_options": {
                # Notice a vanished gateway (silent partition) on any stream.
                "connection_keepalive": {
                    "interval": seconds(topology.timeouts.upstream_keepalive_seconds),
                    "timeout": seconds(topology.timeouts.upstream_keepalive_timeout_seconds),
                },
                "max_concurrent_streams": 1024,
            }
        }
    else:
        protocol = {"http_protocol_options": {}}
    tls = {"transport_socket": _upstream_tls_socket(topology, grpc)} if topology.upstream_tls.enabled else {}
    discovery = {"type": "STATIC"} if all(_is_ip(gw.host) for gw in gateways) else _dns(topology)
    return {
        "name": name,
        **discovery,
        "connect_timeout": seconds(topology.timeouts.connect_seconds),
        # Streams are long and uneven: send each new one to the least busy replica.
        "lb_policy": "LEAST_REQUEST",
        # A health change reaches the workers' load balancers at once, not
        # merged over Envoy's default 1 s window: with it, a gateway that had
        # just turned healthy got no request for that second, so when the
        # other was SIGKILLed then (a rolling update's new pod ready, the old
        # one gone), every retry went back to the dead one (503 "connection
        # refused"; the k8s_netns conversation test). A few gateways change
        # rarely: nothing to merge.
        "common_lb_config": {"update_merge_window": "0s"},
        "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": endpoints}]},
        "typed_extension_protocol_options": {
            _HTTP_OPTIONS: {
                TYPE: f"type.googleapis.com/{_HTTP_OPTIONS}",
                "common_http_protocol_options": {
                    "idle_timeout": seconds(topology.timeouts.upstream_idle_seconds)
                },
                "explicit_http_config": protocol,
            }
        },
        "health_checks": [_health_check(topology, grpc)],
        # Pooled connections to a failed gateway are not reused (in-flight
        # requests on them are ended by the kernel's user timeout below).
        "close_connections_on_host_health_failure": True,
        "outlier_detection": _outlier_detection(),
        "circuit_breakers": _circuit_breakers(),
        "upstream_connection_options": {"tcp_keepalive": _tcp_keepalive(topology)},
        "upstream_bind_config": {"socket_options": [_tcp_user_timeout(topology)]},
        **tls,
    }


def batch_cluster(topology: Topology) -> dict[str, Any]:
    """The one batch service, HTTP/1.1, health-checked on GET /health (a
    draining one answers 503). Plain HTTP: it serves the same public Files
    and Batches API, authenticated by the users' own keys."""
    batch = topology.batch
    endpoint = {"endpoint": {"address": socket_address(batch.host, batch.port)}}
    return {
        "name": BATCH_CLUSTER,
        **({"type": "STATIC"} if _is_ip(batch.host) else _dns(topology)),
        "connect_timeout": seconds(topology.timeouts.connect_seconds),
        "load_assignment": {"cluster_name": BATCH_CLUSTER, "endpoints": [{"lb_endpoints": [endpoint]}]},
        "health_checks": [_health_check(topology, grpc=False)],
        "upstream_connection_options": {"tcp_keepalive": _tcp_keepalive(topology)},
    }


def _dns(topology: Topology) -> dict[str, Any]:
    """Strict DNS resolution (the DNS cluster extension; Cluster's own
    STRICT_DNS fields are deprecated): every address of each name is a
    gateway of its own, health-checked alone (a headless Service's name gives
    every ready pod), re-resolved regularly."""
    dns = topology.dns
    return {
        "cluster_type": {
            "name": "envoy.clusters.dns",
            "typed_config": {
                TYPE: "type.googleapis.com/envoy.extensions.clusters.dns.v3.DnsCluster",
                "dns_refresh_rate": seconds(dns.refresh_seconds),
                "dns_failure_refresh_rate": {
                    "base_interval": seconds(dns.failure_refresh_seconds),
                    "max_interval": seconds(max(dns.failure_refresh_seconds, dns.refresh_seconds)),
                },
                "respect_dns_ttl": dns.respect_ttl,
                "dns_lookup_family": dns.lookup_family,
                # One host per address (strict DNS), not one for them all.
                "all_addresses_in_single_endpoint": False,
            },
        }
    }


def _tcp_keepalive(topology: Topology) -> dict[str, int]:
    """First probe after the keepalive time of silence, then 3 probes over
    the keepalive timeout: a silent gateway's connection is reset within
    about their sum (the HTTP/1.1 cluster has no PINGs)."""
    t = topology.timeouts
    return {"keepalive_time": math.ceil(t.upstream_keepalive_seconds),
            "keepalive_interval": max(1, math.ceil(t.upstream_keepalive_timeout_seconds / 3)),
            "keepalive_probes": 3}


def _tcp_user_timeout(topology: Topology) -> dict[str, Any]:
    """TCP_USER_TIMEOUT: a connection whose sent bytes stay unacknowledged
    for the keepalive bound is reset by the kernel. Keepalive never probes a
    connection with bytes in flight, so without it a request Envoy wrote to a
    gateway cut off without a reset (before health checks drop it) waits for
    the stream idle timeout (minutes); reset, it is retried on another
    gateway, as nothing was answered."""
    t = topology.timeouts
    bound = t.upstream_keepalive_seconds + t.upstream_keepalive_timeout_seconds
    return {"description": "TCP_USER_TIMEOUT", "level": _IPPROTO_TCP, "name": _TCP_USER_TIMEOUT,
            "int_value": math.ceil(bound * 1000), "state": "STATE_PREBIND"}


def _health_check(topology: Topology, grpc: bool) -> dict[str, Any]:
    """Active checks: gRPC health on the gRPC port, GET on the HTTP port."""
    hc = topology.health_check
    check: dict[str, Any] = (
        {"grpc_health_check": {"service_name": hc.grpc_service}} if grpc
        else {"http_health_check": {"path": hc.http_path}}
    )
    return {
        "timeout": seconds(hc.timeout_seconds),
        "interval": seconds(hc.interval_seconds),
        # Default 60 s: a restarted replica would wait a minute to return.
        "no_traffic_interval": seconds(hc.interval_seconds),
        "unhealthy_threshold": hc.unhealthy_threshold,
        "healthy_threshold": hc.healthy_threshold,
        "always_log_health_check_failures": True,
        **check,
    }


def _outlier_detection() -> dict[str, Any]:
    """Passive checks: eject on connection-level failures only (resets,
    refused, timeouts); a gateway answering 503 "no engine" works correctly."""
    return {
        "split_external_local_origin_errors": True,
        "consecutive_local_origin_failure": 3,
        "enforcing_consecutive_local_origin_failure": 100,
        "enforcing_local_origin_success_rate": 0,
        "enforcing_consecutive_5xx": 0,
        "enforcing_consecutive_gateway_failure": 0,
        "enforcing_success_rate": 0,
        "interval": "5s",
        "base_ejection_time": "10s",
        "max_ejection_percent": 50,
    }


def _circuit_breakers() -> dict[str, Any]:
    limit = 100_000  # far above what one machine serves: breakers must not shape traffic
    return {
        "thresholds": [
            {
                "priority": "DEFAULT",
                "max_connections": limit,
                "max_pending_requests": limit,
                "max_requests": limit,
                "max_retries": 1000,
            }
        ]
    }


def _upstream_tls_socket(topology: Topology, grpc: bool) -> dict[str, Any]:
    """Mutual TLS to the gateways (mesh TLS): Envoy's mesh certificate, the
    mesh CA, and the gateways' role name checked as SNI and SAN."""
    up = topology.upstream_tls
    return {
        "name": "envoy.transport_sockets.tls",
        "typed_config": {
            TYPE: "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
            "sni": up.server_name,
            "common_tls_context": {
                # gRPC servers insist on h2 by ALPN; aiohttp speaks HTTP/1.1.
                "alpn_protocols": ["h2"] if grpc else ["http/1.1"],
                "tls_params": {"tls_minimum_protocol_version": "TLSv1_2"},
                "tls_certificates": [
                    {"certificate_chain": {"filename": up.cert_chain}, "private_key": {"filename": up.private_key}}
                ],
                "validation_context": {
                    "trusted_ca": {"filename": up.ca},
                    "match_typed_subject_alt_names": [
                        {"san_type": "DNS", "matcher": {"exact": up.server_name}}
                    ],
                },
            },
        },
    }


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True
