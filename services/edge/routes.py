"""The public listener's routes: health, the chat page's files, the public
gRPC services, the denial of every other gRPC path, the Files + Batches API
(the batch service's) and the rest of the OpenAI HTTP API (the gateways').

The two stream routes (gRPC, HTTP) are each one dict shared by the routes that
use them, so the rendered YAML names each once (an anchor) and points at it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from services.edge.fragments import BATCH_CLUSTER, GRPC_CLUSTER, HTTP_CLUSTER, TYPE, seconds
from services.edge.topology import Topology

__all__ = ["PUBLIC_GRPC_PREFIXES", "WEB_FILES", "virtual_host"]


# Web page files Envoy serves: URL path -> (file in web.root, content type).
WEB_FILES = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/chat.js": ("chat.js", "text/javascript; charset=utf-8"),
    "/chat.css": ("chat.css", "text/css; charset=utf-8"),
}

# The page loads only its own files and talks only to this origin.
_PAGE_CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
             "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")

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


def _routes(topology: Topology) -> list[dict[str, Any]]:
    stream_route = {
        "timeout": "0s",
        "idle_timeout": seconds(topology.timeouts.stream_idle_seconds),
        "retry_policy": {
            # Retried only before any response byte reached the client, so a
            # client never sees two answers. `reset` covers a gateway that died
            # with an idle pooled connection Envoy had not yet seen close (the
            # request is written into the dead socket), and one cut off without
            # a reset (the kernel's TCP_USER_TIMEOUT ends the connection,
            # clusters.py). A first attempt its gateway admitted before dying is
            # kept detached for a resume; the retry runs under its own id
            # (x-envoy-attempt-count), and the detached one expires unused.
            "retry_on": "connect-failure,refused-stream,reset",
            "num_retries": topology.connect_retries,
            "retry_host_predicate": [
                {
                    "name": "envoy.retry_host_predicates.previous_hosts",
                    "typed_config": {
                        TYPE: "type.googleapis.com/envoy.extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate"
                    },
                }
            ],
            # Selection is in memory and cheap, and many tries are needed:
            # LEAST_REQUEST's two-choice pick PREFERS a dead replica (it holds
            # no requests), so with two replicas a pick lands on it 3 times in
            # 4; after 5 tries a retry still went back to it 24% of the time
            # (chaos runs: 503 "retried and the latest reset reason:
            # connection refused"). 0.75^50 is below one in a million.
            "host_selection_retry_max_attempts": 50,
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
    routes += _batch_routes(topology, http) if topology.batch.enabled else []
    routes.append({"name": "openai", "match": {"prefix": "/v1/"}, "route": http})
    # Everything else the gateway's HTTP side serves (/health, /v1 without slash...).
    routes.append({"name": "gateway_http", "match": {"prefix": "/"}, "route": http})
    return routes


# OpenAI's one completion window, "24h" (batch.completion_window_seconds' default).
_BATCH_LINE_IDLE_SECONDS = 86400.0


def _batch_routes(topology: Topology, http: dict[str, Any]) -> list[dict[str, Any]]:
    """/v1/files and /v1/batches (and below) to the batch service. Batch
    input uploads (POST /v1/files) may be far larger than a request body:
    Envoy's body limit is lifted on that route alone, and the batch service
    counts the upload against `batch.max_file_bytes` (413) itself. Retried
    only when the batch service could not be reached (nothing was sent).

    And the batch service's own lines to the gateways (marked by their
    `X-Kvmesh-Batch-Key-Id`): non-streamed, silent while they wait in the
    scheduler's queue (P2, up to the batch's deadline), so their idle
    timeout is the batch's whole completion window. A client faking the header gains nothing: without the batch
    service's credential the gateway refuses it at once (403)."""
    route = {"cluster": BATCH_CLUSTER, "timeout": "0s",
             "idle_timeout": seconds(topology.timeouts.stream_idle_seconds),
             "retry_policy": {"retry_on": "connect-failure,refused-stream", "num_retries": topology.connect_retries}}
    return [
        {
            "name": "files_upload",
            "match": {"path": "/v1/files", "headers": [{"name": ":method", "string_match": {"exact": "POST"}}]},
            "route": route,
            "typed_per_filter_config": {"envoy.filters.http.body_size_limit": {
                TYPE: "type.googleapis.com/envoy.config.route.v3.FilterConfig", "disabled": True}},
        },
        {"name": "files", "match": {"path_separated_prefix": "/v1/files"}, "route": route},
        {"name": "batches", "match": {"path_separated_prefix": "/v1/batches"}, "route": route},
        {"name": "batch_lines", "match": {"prefix": "/v1/", "headers": [
            {"name": "x-kvmesh-batch-key-id", "present_match": True}]},
         "route": {**http, "idle_timeout": seconds(_BATCH_LINE_IDLE_SECONDS)}},
    ]


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


def virtual_host(topology: Topology) -> dict[str, Any]:
    # x-envoy-attempt-count on every upstream request: a retried request
    # gets an id of its own at the gateway (gateway/jobs.py request_id_from).
    vhost: dict[str, Any] = {"name": "kvmesh", "domains": ["*"], "routes": _routes(topology),
                             "include_request_attempt_count": True}
    if topology.cors.allow_origins:
        vhost["typed_per_filter_config"] = {
            "envoy.filters.http.cors": {
                TYPE: "type.googleapis.com/envoy.extensions.filters.http.cors.v3.CorsPolicy",
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
