"""OpenTelemetry traces, under `tracing` in the YAML (services/common/tracing.py;
README "Tracing"). Read by every service and by the launcher's Envoy
rendering; bounds are checked at load by `validation.py`."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["TracingConfig"]


@dataclass
class TracingConfig:
    """Where spans go, and how many. Off by default: with no endpoint no
    service imports the OpenTelemetry SDK or makes a span, so tracing costs
    nothing until it is configured."""

    # The OTLP/HTTP (http/protobuf) receiver's base URL, e.g.
    # "http://127.0.0.1:4318" (an OpenTelemetry Collector, Jaeger or Tempo);
    # spans are posted to <otlp_endpoint>/v1/traces (a URL that already ends
    # in /v1/traces is used as it is). Empty = tracing off. http or https.
    otlp_endpoint: str = ""
    # Prefix of each service's `service.name`: "<service_name>-gateway",
    # "-scheduler", "-engine", "-envoy", "-vllm" (vLLM's own spans). Not empty.
    service_name: str = "kvmesh"
    # Share of new traces recorded, 0 .. 1, for requests that arrive without
    # a sampled/unsampled decision (no `traceparent`); one that brings one is
    # followed (ParentBased), so a trace is kept or dropped whole across the
    # hops. 1.0: every request -- tracing is opt-in, and a test or a
    # debugging session wants every trace; lower it under heavy load.
    sample_ratio: float = 1.0
    # Extra HTTP headers on every export (a collector's auth token, a
    # tenant header). Names lower-case.
    headers: dict[str, str] = field(default_factory=dict)
    # Seconds one export may take before it is given up (the spans of that
    # batch are dropped; serving never waits for an export). Bounds: > 0.
    export_timeout_seconds: float = 5.0

    @property
    def enabled(self) -> bool:
        return bool(self.otlp_endpoint)

    @property
    def traces_url(self) -> str:
        """Where the spans are posted."""
        url = self.otlp_endpoint.rstrip("/")
        return url if url.endswith("/v1/traces") else f"{url}/v1/traces"

    def service(self, role: str) -> str:
        """`service.name` of one kind of service ("gateway", ...)."""
        return f"{self.service_name}-{role}"
