"""The public listener: codec AUTO (HTTP/1.1 and h2c on one port), request
ids kept or generated, JSON access log, Envoy's own errors as OpenAI-style
JSON bodies, optional downstream TLS. Its routes live in routes.py and its
HTTP filters in http_filters.py.
"""

from __future__ import annotations

from typing import Any

from services.edge.fragments import TYPE, seconds, socket_address
from services.edge.http_filters import http_filters
from services.edge.routes import virtual_host
from services.edge.topology import Topology
from services.edge.tracing import hcm_tracing
from services.tools.devcerts import DEFAULT_DIR as DEV_CERT_DIR

__all__ = ["listener"]


_HCM = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"

# Envoy's default cap on a direct response body is 4 KiB; the page is bigger.
_MAX_DIRECT_RESPONSE_BYTES = 1_048_576

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


def listener(topology: Topology) -> dict[str, Any]:
    """The public listener: one HTTP connection manager, TLS when configured."""
    chain: dict[str, Any] = {
        "filters": [{"name": "envoy.filters.network.http_connection_manager",
                     "typed_config": _connection_manager(topology)}]
    }
    if topology.tls.enabled:
        chain["transport_socket"] = _tls_socket(topology)
    return {
        "name": "public",
        "address": socket_address(topology.listener.host, topology.listener.port),
        "per_connection_buffer_limit_bytes": 1_048_576,
        "filter_chains": [chain],
    }


def _connection_manager(topology: Topology) -> dict[str, Any]:
    t = topology.timeouts
    return {
        TYPE: _HCM,
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
                TYPE: "type.googleapis.com/envoy.extensions.request_id.uuid.v3.UuidRequestIdConfig",
                "pack_trace_reason": False,
                "use_request_id_for_trace_sampling": False,
            }
        },
        "request_timeout": "0s",
        "request_headers_timeout": seconds(t.request_headers_seconds),
        "stream_idle_timeout": seconds(t.stream_idle_seconds),
        "common_http_protocol_options": {
            "idle_timeout": seconds(t.connection_idle_seconds),
            "headers_with_underscores_action": "REJECT_REQUEST",
        },
        "http2_protocol_options": {
            # Many concurrent streams per h2 connection (SDKs multiplex).
            "max_concurrent_streams": 1024,
            "initial_stream_window_size": 1_048_576,
            "initial_connection_window_size": 4_194_304,
        },
        "access_log": [_access_log()],
        "local_reply_config": _local_reply_config(topology),
        "route_config": {
            "name": "kvmesh",
            "virtual_hosts": [virtual_host(topology)],
            "max_direct_response_body_size_bytes": _MAX_DIRECT_RESPONSE_BYTES,
        },
        "http_filters": http_filters(topology),
        # Envoy's span per request, the root of its trace (edge/tracing.py).
        **({"tracing": hcm_tracing(topology.tracing)} if topology.tracing.enabled else {}),
    }


def _access_log() -> dict[str, Any]:
    """One JSON line per request on Envoy's stdout."""
    return {
        "name": "envoy.access_loggers.stdout",
        "typed_config": {
            TYPE: "type.googleapis.com/envoy.extensions.access_loggers.stream.v3.StdoutAccessLog",
            "log_format": {"json_format": _ACCESS_LOG_FORMAT},
        },
    }


def _error_mapper(status: int | None, error_type: str, message: str) -> dict[str, Any]:
    """A local-reply mapper giving Envoy's own HTTP errors an OpenAI error body."""
    if status is None:
        op, value, key = "GE", 400, "kvmesh.edge.error_min"
    else:
        op, value, key = "EQ", status, f"kvmesh.edge.error_{status}"
    status_filter = {"comparison": {"op": op, "value": {"default_value": value, "runtime_key": key}}}
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


def _tls_socket(topology: Topology) -> dict[str, Any]:
    tls = topology.tls
    cert = tls.cert_chain or f"{DEV_CERT_DIR}/server.pem"
    key = tls.private_key or f"{DEV_CERT_DIR}/server-key.pem"
    return {
        "name": "envoy.transport_sockets.tls",
        "typed_config": {
            TYPE: "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.DownstreamTlsContext",
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
