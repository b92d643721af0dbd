"""Envoy's OpenTelemetry tracer (README "Tracing"): with an OTLP endpoint,
the public listener starts a span for every request (`envoy.tracers.
opentelemetry`, exported over OTLP/HTTP through its own `otel_collector`
cluster) and passes its W3C `traceparent` to the gateway, whose
`gateway.request` span continues it -- so Envoy's span is the root of the
request's trace (or continues the client's own `traceparent`).

Off (no endpoint, the default and every checked-in rendering): nothing is
rendered, the bootstrap is byte-for-byte what it was without tracing.
`kvmesh up` fills the spec from the mesh config's `tracing:` block
(services/launcher/envoy_config.py); a topology may also set it itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from services.common.config.tracing import TracingConfig
from services.edge.fragments import TYPE, seconds, socket_address

__all__ = ["COLLECTOR_CLUSTER", "TracingSpec", "collector_cluster", "hcm_tracing", "spec_from_config"]

COLLECTOR_CLUSTER = "otel_collector"


@dataclass
class TracingSpec:
    """Where Envoy sends its spans; empty `traces_url` = no tracing."""

    # Full OTLP/HTTP traces URL, e.g. http://127.0.0.1:4318/v1/traces. "" = off.
    traces_url: str = ""
    # `service.name` of Envoy's spans.
    service_name: str = "kvmesh-envoy"
    # Percent of new requests traced (a request bringing a sampled
    # traceparent is traced regardless), 0 .. 100.
    sampling_percent: float = 100.0
    # Extra headers on each export (a collector's token), lower-case names.
    headers: dict[str, str] | None = None
    # Seconds one export may take.
    timeout_seconds: float = 5.0

    @property
    def enabled(self) -> bool:
        return bool(self.traces_url)

    def validate(self) -> str | None:
        """The problem with this spec, or None."""
        if not self.enabled:
            return None
        url = urlsplit(self.traces_url)
        if url.scheme not in ("http", "https") or not url.hostname:
            return f"tracing.traces_url: expected an http(s):// URL, got {self.traces_url!r}"
        if not 0 <= self.sampling_percent <= 100:
            return f"tracing.sampling_percent: must be within 0 .. 100, got {self.sampling_percent}"
        if not self.timeout_seconds > 0:
            return f"tracing.timeout_seconds: must be > 0, got {self.timeout_seconds}"
        return None


def spec_from_config(tracing: TracingConfig) -> TracingSpec:
    """Envoy's tracer as the mesh config's `tracing:` block makes it: the
    same receiver, `<service_name>-envoy`, the same sampling (`kvmesh up`;
    the Kubernetes tracing overlay's topology is checked against it)."""
    if not tracing.enabled:
        return TracingSpec()
    return TracingSpec(traces_url=tracing.traces_url, service_name=tracing.service("envoy"),
                       sampling_percent=tracing.sample_ratio * 100, headers=dict(tracing.headers) or None,
                       timeout_seconds=tracing.export_timeout_seconds)


def hcm_tracing(spec: TracingSpec) -> dict[str, Any]:
    """The connection manager's `tracing` block."""
    http_service: dict[str, Any] = {
        "http_uri": {"uri": spec.traces_url, "cluster": COLLECTOR_CLUSTER,
                     "timeout": seconds(spec.timeout_seconds)},
    }
    if spec.headers:
        http_service["request_headers_to_add"] = [
            {"header": {"key": k, "value": v}} for k, v in sorted(spec.headers.items())]
    return {
        "random_sampling": {"value": spec.sampling_percent},
        "provider": {
            "name": "envoy.tracers.opentelemetry",
            "typed_config": {
                TYPE: "type.googleapis.com/envoy.config.trace.v3.OpenTelemetryConfig",
                "http_service": http_service,
                "service_name": spec.service_name,
            },
        },
    }


def collector_cluster(spec: TracingSpec) -> dict[str, Any]:
    """The OTLP receiver as a cluster (DNS-resolved; TLS for https)."""
    url = urlsplit(spec.traces_url)
    host = url.hostname or ""
    port = url.port or (443 if url.scheme == "https" else 80)
    cluster: dict[str, Any] = {
        "name": COLLECTOR_CLUSTER,
        "type": "STRICT_DNS",
        "connect_timeout": seconds(min(spec.timeout_seconds, 5.0)),
        "load_assignment": {
            "cluster_name": COLLECTOR_CLUSTER,
            "endpoints": [{"lb_endpoints": [{"endpoint": {"address": socket_address(host, port)}}]}],
        },
    }
    if url.scheme == "https":
        cluster["transport_socket"] = {
            "name": "envoy.transport_sockets.tls",
            "typed_config": {
                TYPE: "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
                "sni": host,
            },
        }
    return cluster
