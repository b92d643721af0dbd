"""Topology YAML -> Envoy v3 bootstrap YAML (static resources, no xDS).

    kvmesh envoy render [--topology F] [--out F]   one topology
    kvmesh envoy render --all [--check]            every envoy/*.yaml -> envoy/rendered/

What the rendered Envoy does, and why:
- One public listener, codec AUTO: HTTP/1.1 and h2c (gRPC without TLS) on one port.
- gRPC to the public services only (kvmesh.v1.Inference, grpc.health.v1,
  reflection) goes to the gateways' gRPC ports over HTTP/2; every other gRPC
  path (the internal kvmesh.v1.Scheduler / kvmesh.v1.Engine, anything else
  with a gRPC content-type) is answered by Envoy: 404 / UNIMPLEMENTED. The
  OpenAI HTTP API (/v1/...) and everything else go to their HTTP ports over
  HTTP/1.1 (aiohttp cannot be an HTTP/2 upstream).
- Streams are never cut: route `timeout: 0s` (Envoy's default 15 s kills
  streams) and idle timeouts far above the gateway's 15 s heartbeat.
- A request body over `max_request_bytes` gets 413, counted as it streams
  (body_size_limit filter), not by buffering (the buffer filter would hold a
  gRPC stream until its end).
- Gateways are health-checked actively (gRPC health / GET /health) and
  passively (outlier detection on connection-level failures only: a gateway
  that answers 503 "no engine" is working correctly and must not be ejected).
  Retries only when the request never reached a gateway.
- Envoy's own error answers (413, 429, 503 no healthy upstream) carry an
  OpenAI-style JSON error body; gRPC callers get a gRPC status instead.
- x-request-id: kept when the client sends one, generated otherwise,
  forwarded to the gateway and echoed in the response; JSON access log on stdout.
- CORS: allowed origins' preflights are answered by Envoy; any other
  preflight gets 403 from Envoy (never reaches a gateway).
- Local rate limit: a global bucket and/or one bucket per Authorization
  header value (per API key); 429 + Retry-After.
- Optional TLS with ALPN h2/http1.1; the browser chat page (web/) is served
  by Envoy from files read at start-up.
- Admin (and /stats/prometheus) on loopback only (checked by the topology).
"""

from __future__ import annotations

import argparse
import ipaddress
import sys
from pathlib import Path
from typing import Any

import yaml

from services.tools.devcerts import DEFAULT_DIR as DEV_CERT_DIR
from services.edge.topology import GatewayEndpoint, Topology, TopologyError, load_topology

__all__ = ["ENVOY_DIR", "PUBLIC_GRPC_PREFIXES", "RENDERED_DIR", "main", "render", "render_yaml", "rendered_path_for"]

ROOT = Path(__file__).resolve().parents[2]
ENVOY_DIR = ROOT / "envoy"
RENDERED_DIR = ENVOY_DIR / "rendered"
DEFAULT_TOPOLOGY = ENVOY_DIR / "topology.yaml"

GRPC_CLUSTER = "gateway_grpc"
HTTP_CLUSTER = "gateway_http"

_TYPE = "@type"
_HCM = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
_HTTP_OPTIONS = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
_FILTER_CONFIG = "type.googleapis.com/envoy.config.route.v3.FilterConfig"

# Web page files Envoy serves: URL path -> (file in web.root, content type).
WEB_FILES = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/chat.js": ("chat.js", "text/javascript; charset=utf-8"),
    "/chat.css": ("chat.css", "text/css; charset=utf-8"),
}
# The page loads only its own files and talks only to this origin.
_PAGE_CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
             "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
# Envoy's default cap on a direct response body is 4 KiB; the page is bigger.
_MAX_DIRECT_RESPONSE_BYTES = 1_048_576

# The only gRPC services the public listener forwards: the public API,
# health and reflection. kvmesh.v1.Scheduler and kvmesh.v1.Engine are
# internal (Admit/Connect/Abort would let a client hold leases, pose as an
# engine or cancel anyone's request); Envoy answers them, and any other gRPC
# path, itself (404 -> gRPC UNIMPLEMENTED) without reaching a gateway.
PUBLIC_GRPC_PREFIXES = ("/kvmesh.v1.Inference/", "/grpc.reflection.", "/grpc.health.v1.Health/")
_NOT_PUBLIC = {
    "status": 404,
    "body": {"inline_string": "this gRPC service is not served on the public listener; "
                              "use kvmesh.v1.Inference\n"},
}

_ACCESS_LOG_FORMAT = {
    "time": "%START_TIME%",
    "request_id": "%REQ(X-REQUEST-ID)%",
    "method": "%REQ(:METHOD)%",
    "path": "%REQ(X-ENVOY-ORIGINAL-PATH?:PATH)%",
    "protocol": "%PROTOCOL%",
    "status": "%RESPONSE_CODE%",
    "grpc_status": "%GRPC_STATUS%",
    "flags": "%RESPONSE_FLAGS%",
    "details": "%RESPONSE_CODE_DETAILS%",
    "bytes_in": "%BYTES_RECEIVED%",
    "bytes_out": "%BYTES_SENT%",
    "duration_ms": "%DURATION%",
    "upstream": "%UPSTREAM_HOST%",
    "client": "%DOWNSTREAM_REMOTE_ADDRESS%",
    "user_agent": "%REQ(USER-AGENT)%",
}


def _seconds(value: float) -> str:
    """Protobuf Duration in YAML ("2s", "0.5s")."""
    text = f"{value:.3f}".rstrip("0").rstrip(".")
    return f"{text}s"


def _socket(host: str, port: int) -> dict[str, Any]:
    return {"socket_address": {"address": host, "port_value": port}}


# ---------------------------------------------------------------- listener


def _routes(topology: Topology) -> list[dict[str, Any]]:
    stream_route = {
        "timeout": "0s",
        "idle_timeout": _seconds(topology.timeouts.stream_idle_seconds),
        "retry_policy": {
            # Retried only before any response byte reached the client, so a
            # client never sees two answers. `reset` covers a gateway that died
            # with an idle pooled connection Envoy had not yet seen close (the
            # request is written into the dead socket): a lost connection always
            # cancels its generation in the gateway (or died with it), so the
            # retry cannot run alongside the first attempt.
            "retry_on": "connect-failure,refused-stream,reset",
            "num_retries": topology.connect_retries,
            "retry_host_predicate": [
                {
                    "name": "envoy.retry_host_predicates.previous_hosts",
                    "typed_config": {
                        _TYPE: "type.googleapis.com/envoy.extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate"
                    },
                }
            ],
            # Selection is in memory and cheap; with LEAST_REQUEST's random
            # two-choice pick, several tries make landing on the failed
            # replica again vanishingly unlikely (0.5^6 with two replicas).
            "host_selection_retry_max_attempts": 5,
        },
    }
    grpc = {"cluster": GRPC_CLUSTER, **stream_route}
    http = {"cluster": HTTP_CLUSTER, **stream_route}
    routes: list[dict[str, Any]] = [
        {
            "name": "healthz",
            "match": {"path": "/healthz"},
            "direct_response": {"status": 200, "body": {"inline_string": "ok\n"}},
        },
        *_web_routes(topology),
    ]
    for prefix in PUBLIC_GRPC_PREFIXES:
        name = "grpc" if prefix == "/kvmesh.v1.Inference/" else f"grpc{prefix.rstrip('./')}"
        routes.append({"name": name, "match": {"prefix": prefix}, "route": grpc})
    # Internal kvmesh services by path (with or without a gRPC content-type),
    # then any other gRPC call: answered here, never forwarded.
    routes.append({"name": "grpc_internal_denied", "match": {"prefix": "/kvmesh.v1."},
                   "direct_response": _NOT_PUBLIC})
    routes.append({
        "name": "grpc_other_denied",
        "match": {"prefix": "/", "headers": [
            {"name": "content-type", "string_match": {"prefix": "application/grpc"}}]},
        "direct_response": _NOT_PUBLIC,
    })
    routes.append({"name": "openai", "match": {"prefix": "/v1/"}, "route": http})
    # Everything else the gateway's HTTP side serves (/health, /v1 without slash...).
    routes.append({"name": "gateway_http", "match": {"prefix": "/"}, "route": http})
    return routes


def _web_routes(topology: Topology) -> list[dict[str, Any]]:
    if not topology.web.enabled:
        return []
    routes = []
    for path, (name, content_type) in WEB_FILES.items():
        headers = {
            "content-type": content_type,
            "cache-control": "no-cache",
            "x-content-type-options": "nosniff",
            "referrer-policy": "no-referrer",
        }
        if name.endswith(".html"):
            headers["content-security-policy"] = _PAGE_CSP
        routes.append({
            "name": f"web{path.replace('/', '_').replace('.', '_')}",
            "match": {"path": path, "headers": [{"name": ":method", "string_match": {"exact": "GET"}}]},
            "direct_response": {"status": 200, "body": {"filename": str(Path(topology.web.root) / name)}},
            "response_headers_to_add": [
                {"append_action": "OVERWRITE_IF_EXISTS_OR_ADD", "header": {"key": k, "value": v}}
                for k, v in headers.items()
            ],
        })
    return routes


def _virtual_host(topology: Topology) -> dict[str, Any]:
    vhost: dict[str, Any] = {"name": "kvmesh", "domains": ["*"], "routes": _routes(topology)}
    if topology.cors.allow_origins:
        vhost["typed_per_filter_config"] = {
            "envoy.filters.http.cors": {
                _TYPE: "type.googleapis.com/envoy.extensions.filters.http.cors.v3.CorsPolicy",
                "allow_origin_string_match": [{"exact": o} for o in topology.cors.allow_origins],
                "allow_methods": "GET, POST, OPTIONS",
                "allow_headers": (
                    "authorization, content-type, x-priority, x-request-id, "
                    "x-grpc-web, x-user-agent, grpc-timeout"
                ),
                "expose_headers": "x-request-id, retry-after, grpc-status, grpc-message",
                "max_age": str(topology.cors.max_age_seconds),
            }
        }
    return vhost


def _http_filters(topology: Topology) -> list[dict[str, Any]]:
    filters: list[dict[str, Any]] = []
    if topology.cors.allow_origins:
        # First, so preflights are answered before limits apply.
        filters.append({
            "name": "envoy.filters.http.cors",
            "typed_config": {_TYPE: "type.googleapis.com/envoy.extensions.filters.http.cors.v3.Cors"},
        })
    # The CORS filter answered every preflight from an allowed origin (it
    # needs a routed request to find its policy, so this cannot be a route);
    # any preflight still here is from another origin: 403 from Envoy.
    filters.append({
        "name": "envoy.filters.http.rbac",
        "typed_config": {
            _TYPE: "type.googleapis.com/envoy.extensions.filters.http.rbac.v3.RBAC",
            "rules": {
                "action": "DENY",
                "policies": {
                    "foreign_cors_preflight": {
                        "permissions": [{"and_rules": {"rules": [
                            {"header": {"name": ":method", "string_match": {"exact": "OPTIONS"}}},
                            {"header": {"name": "access-control-request-method", "present_match": True}},
                        ]}}],
                        "principals": [{"any": True}],
                    }
                },
            },
        },
    })
    limiter = _local_rate_limit(topology)
    if limiter is not None:
        filters.append(limiter)
    filters.append({
        "name": "envoy.filters.http.body_size_limit",
        "typed_config": {
            _TYPE: "type.googleapis.com/envoy.extensions.filters.http.body_size_limit.v3.BodySizeLimit",
            "max_request_bytes": topology.max_request_bytes,
        },
    })
    if topology.transcoder.enabled:
        filters.append({
            "name": "envoy.filters.http.grpc_json_transcoder",
            "typed_config": {
                _TYPE: "type.googleapis.com/envoy.extensions.filters.http.grpc_json_transcoder.v3.GrpcJsonTranscoder",
                "proto_descriptor": topology.transcoder.descriptor,
                "services": ["kvmesh.v1.Inference"],
                "convert_grpc_status": True,
                "print_options": {
                    "always_print_primitive_fields": True,
                    # Server-streaming methods become `data: {...}` SSE events.
                    "stream_sse_style_delimited": True,
                },
                "request_validation_options": {
                    "reject_unknown_method": False,
                    "reject_unknown_query_parameters": False,
                },
            },
        })
    filters.append({
        "name": "envoy.filters.http.router",
        "typed_config": {_TYPE: "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"},
    })
    return filters


def _bucket(rate: float, burst: int) -> dict[str, Any]:
    """A token bucket of `rate` requests/s holding `burst` (0 = one second's
    worth), refilled every ~100 ms so the rate stays smooth."""
    tokens_per_fill = max(1, round(rate / 10))
    return {
        "max_tokens": burst or max(1, int(rate)),
        "tokens_per_fill": tokens_per_fill,
        "fill_interval": _seconds(max(tokens_per_fill / rate, 0.001)),
    }


def _local_rate_limit(topology: Topology) -> dict[str, Any] | None:
    rate = topology.rate_limit
    per_key = rate.per_key_requests_per_second > 0
    if rate.requests_per_second <= 0 and not per_key:
        return None
    config: dict[str, Any] = {
        _TYPE: "type.googleapis.com/envoy.extensions.filters.http.local_ratelimit.v3.LocalRateLimit",
        "stat_prefix": "edge_rate_limit",
        # The default bucket is the global guard; without one it must never run dry.
        "token_bucket": (_bucket(rate.requests_per_second, rate.burst) if rate.requests_per_second > 0
                         else {"max_tokens": 1_000_000_000, "tokens_per_fill": 1_000_000_000,
                               "fill_interval": "1s"}),
        "filter_enabled": {"default_value": {"numerator": 100, "denominator": "HUNDRED"}},
        "filter_enforced": {"default_value": {"numerator": 100, "denominator": "HUNDRED"}},
        "rate_limited_as_resource_exhausted": True,
        "response_headers_to_add": [
            {"append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
             "header": {"key": "retry-after", "value": "1"}}
        ],
    }
    if per_key:
        # A descriptor entry without a value is a wildcard: Envoy keeps one
        # bucket per distinct header value (up to max_keys, LRU). No header
        # -> no descriptor -> only the global bucket applies.
        config.update({
            "always_consume_default_token_bucket": rate.requests_per_second > 0,
            "max_dynamic_descriptors": rate.max_keys,
            "rate_limits": [
                {"actions": [{"request_headers": {"header_name": "authorization", "descriptor_key": "api_key"}}]}
            ],
            "descriptors": [
                {"entries": [{"key": "api_key"}],
                 "token_bucket": _bucket(rate.per_key_requests_per_second, rate.per_key_burst)}
            ],
        })
    return {"name": "envoy.filters.http.local_ratelimit", "typed_config": config}


def _error_mapper(status: int | None, error_type: str, message: str) -> dict[str, Any]:
    """A local-reply mapper giving Envoy's own HTTP errors an OpenAI error body."""
    if status is None:
        status_filter = {"comparison": {"op": "GE", "value": {"default_value": 400, "runtime_key": "kvmesh.edge.error_min"}}}
    else:
        status_filter = {"comparison": {"op": "EQ", "value": {"default_value": status, "runtime_key": f"kvmesh.edge.error_{status}"}}}
    return {
        "filter": {"status_code_filter": status_filter},
        "body_format_override": {
            "json_format": {
                "error": {
                    "message": message,
                    "type": error_type,
                    "code": "%RESPONSE_CODE%",
                    "param": None,
                    "request_id": "%REQ(X-REQUEST-ID)%",
                }
            }
        },
    }


def _local_reply_config(topology: Topology) -> dict[str, Any]:
    return {
        "mappers": [
            _error_mapper(
                413, "invalid_request_error",
                f"request body larger than {topology.max_request_bytes} bytes; send a smaller prompt",
            ),
            _error_mapper(429, "rate_limit_error", "too many requests at the edge; retry after a second"),
            # Only the preflight guard answers 403 at the edge.
            _error_mapper(403, "permission_error",
                          "CORS preflight refused: the Origin is not in the edge's cors.allow_origins"),
            _error_mapper(None, "edge_error", "%LOCAL_REPLY_BODY% (%RESPONSE_CODE_DETAILS%)"),
        ]
    }


def _listener(topology: Topology) -> dict[str, Any]:
    t = topology.timeouts
    hcm = {
        _TYPE: _HCM,
        "stat_prefix": "edge",
        "codec_type": "AUTO",
        "use_remote_address": True,
        "generate_request_id": True,
        # Keep a client's own x-request-id so its logs and ours line up.
        "preserve_external_request_id": True,
        "always_set_request_id_in_response": True,
        # Envoy's default UUID extension rewrites one character of a 36-char
        # id to pack tracing state into it; the id must reach the gateway,
        # scheduler and engine exactly as the client sent it.
        "request_id_extension": {
            "typed_config": {
                _TYPE: "type.googleapis.com/envoy.extensions.request_id.uuid.v3.UuidRequestIdConfig",
                "pack_trace_reason": False,
                "use_request_id_for_trace_sampling": False,
            }
        },
        "request_timeout": "0s",
        "request_headers_timeout": _seconds(t.request_headers_seconds),
        "stream_idle_timeout": _seconds(t.stream_idle_seconds),
        "common_http_protocol_options": {
            "idle_timeout": _seconds(t.connection_idle_seconds),
            "headers_with_underscores_action": "REJECT_REQUEST",
        },
        "http2_protocol_options": {
            # Many concurrent streams per h2 connection (SDKs multiplex).
            "max_concurrent_streams": 1024,
            "initial_stream_window_size": 1_048_576,
            "initial_connection_window_size": 4_194_304,
        },
        "access_log": [
            {
                "name": "envoy.access_loggers.stdout",
                "typed_config": {
                    _TYPE: "type.googleapis.com/envoy.extensions.access_loggers.stream.v3.StdoutAccessLog",
                    "log_format": {"json_format": _ACCESS_LOG_FORMAT},
                },
            }
        ],
        "local_reply_config": _local_reply_config(topology),
        "route_config": {
            "name": "kvmesh",
            "virtual_hosts": [_virtual_host(topology)],
            "max_direct_response_body_size_bytes": _MAX_DIRECT_RESPONSE_BYTES,
        },
        "http_filters": _http_filters(topology),
    }
    chain: dict[str, Any] = {
        "filters": [{"name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}]
    }
    if topology.tls.enabled:
        chain["transport_socket"] = _tls_socket(topology)
    return {
        "name": "public",
        "address": _socket(topology.listener.host, topology.listener.port),
        "per_connection_buffer_limit_bytes": 1_048_576,
        "filter_chains": [chain],
    }


def _tls_socket(topology: Topology) -> dict[str, Any]:
    tls = topology.tls
    cert = tls.cert_chain or f"{DEV_CERT_DIR}/server.pem"
    key = tls.private_key or f"{DEV_CERT_DIR}/server-key.pem"
    return {
        "name": "envoy.transport_sockets.tls",
        "typed_config": {
            _TYPE: "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.DownstreamTlsContext",
            "common_tls_context": {
                # h2 first: gRPC requires it, browsers prefer it; HTTP/1.1 for the rest.
                "alpn_protocols": ["h2", "http/1.1"],
                "tls_params": {"tls_minimum_protocol_version": "TLSv1_2"},
                "tls_certificates": [
                    {"certificate_chain": {"filename": cert}, "private_key": {"filename": key}}
                ],
            },
        },
    }


# ---------------------------------------------------------------- clusters


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _cluster(topology: Topology, name: str, grpc: bool) -> dict[str, Any]:
    gateways: list[GatewayEndpoint] = topology.gateways
    hc = topology.health_check
    endpoints = [
        {"endpoint": {"address": _socket(gw.host, gw.grpc_port if grpc else gw.http_port)}}
        for gw in gateways
    ]
    if grpc:
        protocol: dict[str, Any] = {
            "http2_protocol_options": {
                # Notice a vanished gateway on long-idle streams.
                "connection_keepalive": {"interval": "30s", "timeout": "10s"},
                "max_concurrent_streams": 1024,
            }
        }
        check: dict[str, Any] = {"grpc_health_check": {"service_name": hc.grpc_service}}
    else:
        protocol = {"http_protocol_options": {}}
        check = {"http_health_check": {"path": hc.http_path}}
    limit = 100_000  # far above what one machine serves: breakers must not shape traffic
    tls = {"transport_socket": _upstream_tls_socket(topology, grpc)} if topology.upstream_tls.enabled else {}
    return {
        "name": name,
        "type": "STATIC" if all(_is_ip(gw.host) for gw in gateways) else "STRICT_DNS",
        "connect_timeout": _seconds(topology.timeouts.connect_seconds),
        # Streams are long and uneven: send each new one to the least busy replica.
        "lb_policy": "LEAST_REQUEST",
        "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": endpoints}]},
        "typed_extension_protocol_options": {
            _HTTP_OPTIONS: {
                _TYPE: f"type.googleapis.com/{_HTTP_OPTIONS}",
                "common_http_protocol_options": {
                    "idle_timeout": _seconds(topology.timeouts.upstream_idle_seconds)
                },
                "explicit_http_config": protocol,
            }
        },
        "health_checks": [
            {
                "timeout": _seconds(hc.timeout_seconds),
                "interval": _seconds(hc.interval_seconds),
                # Default 60 s: a restarted replica would wait a minute to return.
                "no_traffic_interval": _seconds(hc.interval_seconds),
                "unhealthy_threshold": hc.unhealthy_threshold,
                "healthy_threshold": hc.healthy_threshold,
                "always_log_health_check_failures": True,
                **check,
            }
        ],
        "outlier_detection": {
            # Eject on connection-level failures only (resets, refused, timeouts).
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
        },
        "circuit_breakers": {
            "thresholds": [
                {
                    "priority": "DEFAULT",
                    "max_connections": limit,
                    "max_pending_requests": limit,
                    "max_requests": limit,
                    "max_retries": 1000,
                }
            ]
        },
        "upstream_connection_options": {
            "tcp_keepalive": {"keepalive_time": 60, "keepalive_interval": 10, "keepalive_probes": 3}
        },
        **tls,
    }


def _upstream_tls_socket(topology: Topology, grpc: bool) -> dict[str, Any]:
    """Mutual TLS to the gateways (mesh TLS): Envoy's mesh certificate, the
    mesh CA, and the gateways' role name checked as SNI and SAN."""
    up = topology.upstream_tls
    return {
        "name": "envoy.transport_sockets.tls",
        "typed_config": {
            _TYPE: "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
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


# ---------------------------------------------------------------- bootstrap


def render(topology: Topology) -> dict[str, Any]:
    """The Envoy bootstrap for `topology`, as plain data."""
    topology.validate()
    return {
        "node": {"id": "kvmesh-edge", "cluster": "kvmesh"},
        "admin": {"address": _socket(topology.admin.host, topology.admin.port)},
        "static_resources": {
            "listeners": [_listener(topology)],
            "clusters": [
                _cluster(topology, GRPC_CLUSTER, grpc=True),
                _cluster(topology, HTTP_CLUSTER, grpc=False),
            ],
        },
        "overload_manager": {
            "resource_monitors": [
                {
                    "name": "envoy.resource_monitors.global_downstream_max_connections",
                    "typed_config": {
                        _TYPE: "type.googleapis.com/envoy.extensions.resource_monitors.downstream_connections.v3.DownstreamConnectionsConfig",
                        "max_active_downstream_connections": topology.max_connections,
                    },
                }
            ]
        },
    }


def render_yaml(topology: Topology, source: str = "") -> str:
    """The bootstrap as YAML text, with a header naming its source."""
    header = (
        f"# Generated by `kvmesh envoy render` from {source or 'a topology'}; do not edit.\n"
        "# Re-render with `make render`.\n"
    )
    return header + yaml.safe_dump(render(topology), sort_keys=False, default_flow_style=False)


def rendered_path_for(topology_path: Path) -> Path:
    """envoy/topology.yaml -> envoy/rendered/envoy.yaml;
    envoy/topology-NAME.yaml -> envoy/rendered/envoy-NAME.yaml."""
    stem = topology_path.stem
    suffix = stem[len("topology"):] if stem.startswith("topology") else f"-{stem}"
    return RENDERED_DIR / f"envoy{suffix}.yaml"


def _topologies() -> list[Path]:
    return sorted(p for p in ENVOY_DIR.glob("*.yaml") if p.is_file())


def _relative(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvmesh envoy render", description=__doc__.splitlines()[0])
    parser.add_argument("--topology", type=Path, default=DEFAULT_TOPOLOGY,
                        help=f"topology YAML (default {_relative(DEFAULT_TOPOLOGY)})")
    parser.add_argument("--out", type=Path, help="output file (default: envoy/rendered/...; '-' = stdout)")
    parser.add_argument("--all", action="store_true", help="render every envoy/*.yaml")
    parser.add_argument("--check", action="store_true",
                        help="write nothing; fail if a rendered file is missing or out of date")
    args = list(sys.argv[1:] if argv is None else argv)
    # `kvmesh envoy render ...` hands us ["render", ...]; render is the only verb.
    if not args or args[0] != "render":
        parser.error("usage: kvmesh envoy render [--topology F] [--out F] [--all] [--check]")
    ns = parser.parse_args(args[1:])
    if ns.all and ns.out:
        parser.error("--out cannot be used with --all")
    jobs = [(p, rendered_path_for(p)) for p in _topologies()] if ns.all else [
        (ns.topology, ns.out or rendered_path_for(ns.topology))
    ]
    stale: list[str] = []
    for source, out in jobs:
        try:
            text = render_yaml(load_topology(source), _relative(source))
        except TopologyError as exc:
            print(f"kvmesh envoy render: {exc}", file=sys.stderr)
            return 2
        if str(out) == "-":
            sys.stdout.write(text)
        elif ns.check:
            if not out.exists() or out.read_text() != text:
                stale.append(f"{_relative(out)} (from {_relative(source)})")
        else:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(text)
            print(f"rendered {_relative(source)} -> {_relative(out)}")
    if stale:
        print("kvmesh envoy render: out of date, run `make render`: " + ", ".join(stale), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
