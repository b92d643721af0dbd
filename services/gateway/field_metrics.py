"""The gateway's series under the field's own names, beside kvmesh's: the
OpenTelemetry GenAI semantic-convention metrics and the Gateway API Inference
Extension's (GIE) `inference_objective_*`, so dashboards and alerts written
for those read a kvmesh gateway unchanged.

OpenTelemetry names are given the OTel -> Prometheus way (dots -> `_`, the
unit `s` -> `_seconds`, annotation units such as `{token}` dropped), their
attributes likewise (`gen_ai.request.model` -> `gen_ai_request_model`), with
the semantic conventions' recommended explicit bucket boundaries
(semantic-conventions docs/gen-ai/gen-ai-metrics.md). `gen_ai_system` is the
attribute the GenAI conventions used up to v1.36 (what the contract names);
v1.37 renamed it `gen_ai.provider.name`, so both labels are set ("kvmesh").

GIE names and labels are its EPP's (pkg/epp/metrics): `model_name` is the
model the client asked for, `target_model_name` the model that served it
(the same here: kvmesh does no model rewriting).

Recorded once per request by `request_meter.RequestMeter`, never per token.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

__all__ = ["FieldMetrics", "GEN_AI_SYSTEM"]

GEN_AI_SYSTEM = "kvmesh"

# Semantic-convention bucket boundaries (gen-ai-metrics.md).
_OTEL_TOKEN_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304,
                       16777216, 67108864)
_OTEL_DURATION_BUCKETS = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48,
                          40.96, 81.92)
_OTEL_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                      7.5, 10.0)
_OTEL_TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
# GIE's own boundaries (pkg/epp/metrics/metrics.go).
_GIE_DURATION_BUCKETS = (0.005, 0.025, 0.05, 0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 1.25, 1.5, 2, 3, 4, 5, 6, 8, 10,
                         15, 20, 30, 45, 60, 120, 180, 240, 300, 360, 480, 600, 900, 1200, 1800, 2700, 3600)
_GIE_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32778, 65536, 131072,
                      262144, 524288, 1048576)

_GEN_AI_LABELS = ["gen_ai_operation_name", "gen_ai_request_model", "gen_ai_system", "gen_ai_provider_name"]
_GIE_LABELS = ["model_name", "target_model_name"]


def gen_ai_operation(route: str) -> str:
    """The semconv `gen_ai.operation.name` of a gateway route."""
    return "chat" if route == "chat" else "text_completion"


class FieldMetrics:
    def __init__(self, r: CollectorRegistry) -> None:
        def otel(name: str, doc: str, buckets: tuple[float, ...], extra: tuple[str, ...] = ()) -> Histogram:
            return Histogram(name, doc, [*_GEN_AI_LABELS, *extra], buckets=buckets, registry=r)

        self.gen_ai_ttft = otel("gen_ai_server_time_to_first_token_seconds",
                                "gen_ai.server.time_to_first_token: arrival to the first token, successful "
                                "responses", _OTEL_TTFT_BUCKETS)
        self.gen_ai_tpot = otel("gen_ai_server_time_per_output_token_seconds",
                                "gen_ai.server.time_per_output_token: (end - first token) / (output tokens - 1), "
                                "successful responses", _OTEL_TPOT_BUCKETS)
        self.gen_ai_request = otel("gen_ai_server_request_duration_seconds",
                                   "gen_ai.server.request.duration: arrival to the last token; error_type set "
                                   "when it failed", _OTEL_DURATION_BUCKETS, ("error_type",))
        self.gen_ai_operation = otel("gen_ai_client_operation_duration_seconds",
                                     "gen_ai.client.operation.duration: the whole operation as its OpenAI client "
                                     "sees it at the gateway (kvmesh's edge)", _OTEL_DURATION_BUCKETS,
                                     ("error_type",))
        self.gen_ai_tokens = otel("gen_ai_client_token_usage",
                                  "gen_ai.client.token.usage: input and output tokens per operation",
                                  _OTEL_TOKEN_BUCKETS, ("gen_ai_token_type",))
        self.gie_requests = Counter("inference_objective_request", "GIE: requests per model",
                                    _GIE_LABELS, registry=r)
        self.gie_errors = Counter("inference_objective_request_error", "GIE: failed requests per model, by "
                                  "error code", [*_GIE_LABELS, "error_code"], registry=r)
        self.gie_duration = Histogram("inference_objective_request_duration_seconds",
                                      "GIE: request latency (arrival to the last token), successful requests",
                                      _GIE_LABELS, buckets=_GIE_DURATION_BUCKETS, registry=r)
        self.gie_input = Histogram("inference_objective_input_tokens", "GIE: prompt tokens per request",
                                   _GIE_LABELS, buckets=_GIE_TOKEN_BUCKETS, registry=r)
        self.gie_output = Histogram("inference_objective_output_tokens", "GIE: output tokens per request",
                                    _GIE_LABELS, buckets=_GIE_TOKEN_BUCKETS, registry=r)
        self.gie_running = Gauge("inference_objective_running_requests", "GIE: requests in flight per model",
                                 ["model_name"], registry=r)

    def gen_ai_labels(self, route: str, model: str) -> tuple[str, str, str, str]:
        return (gen_ai_operation(route), model, GEN_AI_SYSTEM, GEN_AI_SYSTEM)
