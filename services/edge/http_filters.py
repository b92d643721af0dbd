"""The public listener's HTTP filters, in order: CORS (answers allowed
origins' preflights), a guard refusing every other preflight (403), the local
rate limit (a global bucket and/or one per API key; 429 + Retry-After), the
request body size limit (413, counted as the body streams), optional gRPC-JSON
transcoding, and the router.
"""

from __future__ import annotations

from typing import Any

from services.edge.fragments import TYPE, seconds
from services.edge.topology import Topology

__all__ = ["http_filters"]


def http_filters(topology: Topology) -> list[dict[str, Any]]:
    """The listener's HTTP filter chain, in the order Envoy runs it."""
    filters: list[dict[str, Any]] = []
    if topology.cors.allow_origins:
        # First, so preflights are answered before limits apply.
        filters.append({
            "name": "envoy.filters.http.cors",
            "typed_config": {TYPE: "type.googleapis.com/envoy.extensions.filters.http.cors.v3.Cors"},
        })
    filters.append(_foreign_preflight_guard())
    limiter = _local_rate_limit(topology)
    if limiter is not None:
        filters.append(limiter)
    filters.append({
        "name": "envoy.filters.http.body_size_limit",
        "typed_config": {
            TYPE: "type.googleapis.com/envoy.extensions.filters.http.body_size_limit.v3.BodySizeLimit",
            "max_request_bytes": topology.max_request_bytes,
        },
    })
    if topology.transcoder.enabled:
        filters.append(_transcoder(topology))
    filters.append({
        "name": "envoy.filters.http.router",
        "typed_config": {TYPE: "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"},
    })
    return filters


def _foreign_preflight_guard() -> dict[str, Any]:
    """The CORS filter answered every preflight from an allowed origin (it
    needs a routed request to find its policy, so this cannot be a route);
    any preflight still here is from another origin: 403 from Envoy."""
    return {
        "name": "envoy.filters.http.rbac",
        "typed_config": {
            TYPE: "type.googleapis.com/envoy.extensions.filters.http.rbac.v3.RBAC",
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
    }


def _transcoder(topology: Topology) -> dict[str, Any]:
    """gRPC-JSON transcoding of the public API (kvmesh.v1.Inference)."""
    return {
        "name": "envoy.filters.http.grpc_json_transcoder",
        "typed_config": {
            TYPE: "type.googleapis.com/envoy.extensions.filters.http.grpc_json_transcoder.v3.GrpcJsonTranscoder",
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
    }


def _bucket(rate: float, burst: int) -> dict[str, Any]:
    """A token bucket of `rate` requests/s holding `burst` (0 = one second's
    worth), refilled every ~100 ms so the rate stays smooth."""
    tokens_per_fill = max(1, round(rate / 10))
    return {
        "max_tokens": burst or max(1, int(rate)),
        "tokens_per_fill": tokens_per_fill,
        "fill_interval": seconds(max(tokens_per_fill / rate, 0.001)),
    }


def _local_rate_limit(topology: Topology) -> dict[str, Any] | None:
    rate = topology.rate_limit
    per_key = rate.per_key_requests_per_second > 0
    if rate.requests_per_second <= 0 and not per_key:
        return None
    config: dict[str, Any] = {
        TYPE: "type.googleapis.com/envoy.extensions.filters.http.local_ratelimit.v3.LocalRateLimit",
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
