"""Fleet overview: what clients get -- requests, latency by priority class,
tokens, refusals, migrations and resumes -- measured at the gateways, beside
the Gateway API Inference Extension and OpenTelemetry GenAI names."""

from __future__ import annotations

from services.observability.panels import Board, Panel, Query, Row, latency_quantiles, rate

__all__ = ["BOARD"]

_GW = 'model_name=~"$model", priority=~"$priority"'
_API = 'route!~"/health.*"'

_traffic = Row("Traffic", (
    Panel("Requests / s by status", "reqps", (
        Query(rate("kvmesh_gateway_requests_total", "status", _API), "{{status}}"),
    ), "Every API request by its final status (HTTP code or gRPC status)."),
    Panel("Requests / s by model (GIE)", "reqps", (
        Query(rate("inference_objective_request_total", "model_name", 'model_name=~"$model"'), "{{model_name}}"),
    ), "Gateway API Inference Extension: inference_objective_request_total."),
    Panel("Requests in flight", "short", (
        Query("sum(kvmesh_gateway_active_streams)", "gateways"),
        Query('sum by (model_name) (inference_objective_running_requests{model_name=~"$model"})',
              "running {{model_name}}"),
    )),
    Panel("Tokens / s in and out", "short", (
        Query(rate("kvmesh_gateway_prompt_tokens_total", "priority", _GW), "in {{priority}}"),
        Query(rate("kvmesh_gateway_generation_tokens_total", "priority", _GW), "out {{priority}}"),
    ), "Prompt and generated tokens per second, by priority class."),
    Panel("Engines serving per model", "short", (
        # Every scheduler replica reports the whole fleet: one figure per engine, then the count.
        Query('sum by (model_name) (max by (model_name, engine) '
              '(kvmesh_scheduler_engine_serving{model_name=~"$model"}))', "{{model_name}}"),
    ), "Engines the scheduler can place on now; 0 = the model is down.", kind="stat"),
    Panel("Finished by reason / s", "ops", (
        Query(rate("kvmesh_gateway_finished_total", "reason"), "{{reason}}"),
    )),
))

_latency = Row("Latency by priority class (gateway)", (
    Panel("Time to first token", "s", latency_quantiles("kvmesh_gateway_time_to_first_token_seconds",
                                                           "priority", _GW),
          "Arrival at the gateway to the first token: queueing + prefill."),
    Panel("Inter-token latency", "s", latency_quantiles("kvmesh_gateway_inter_token_latency_seconds",
                                                          "priority", _GW)),
    Panel("End-to-end request latency", "s", latency_quantiles("kvmesh_gateway_e2e_request_latency_seconds",
                                                                 "priority", _GW)),
))

_refusals = Row("Errors, refusals, migrations", (
    Panel("Rejections / s by reason", "ops", (
        Query(rate("kvmesh_gateway_rejections_total", "reason"), "gateway {{reason}}"),
        Query(rate("kvmesh_scheduler_rejections_total", "reason"), "scheduler {{reason}}"),
    ), "Every refusal: 4xx by OpenAI error code, 429 rate limit, queue full, no engine."),
    Panel("Errors / s by code (GIE)", "ops", (
        Query(rate("inference_objective_request_error_total", "error_code", 'model_name=~"$model"'),
              "{{error_code}}"),
    )),
    Panel("Migrations, resumes, preemptions / s", "ops", (
        Query(rate("kvmesh_gateway_migrations_total"), "migrations"),
        Query(rate("kvmesh_gateway_resumes_total", "result"), "resume {{result}}"),
        Query(rate("kvmesh_gateway_preemptions_total", "priority", 'priority=~"$priority"'),
              "preempted {{priority}}"),
    ), "Streams moved off a failed engine, resumed by their client, or preempted for a higher class."),
))

_M = 'gen_ai_request_model=~"$model"'
_genai = Row("OpenTelemetry GenAI semantic conventions", (
    Panel("gen_ai.server.time_to_first_token", "s",
          latency_quantiles("gen_ai_server_time_to_first_token_seconds", "gen_ai_request_model", _M, (0.5, 0.95))),
    Panel("gen_ai.server.time_per_output_token", "s",
          latency_quantiles("gen_ai_server_time_per_output_token_seconds", "gen_ai_request_model", _M,
                            (0.5, 0.95))),
    Panel("gen_ai.server.request.duration", "s",
          latency_quantiles("gen_ai_server_request_duration_seconds", "gen_ai_operation_name", _M, (0.5, 0.95))),
    Panel("gen_ai.client.token.usage / s", "short", (
        Query(f"sum by (gen_ai_token_type) (rate(gen_ai_client_token_usage_sum{{{_M}}}[$__rate_interval]))",
              "{{gen_ai_token_type}}"),
    )),
    Panel("gen_ai.client.operation.duration", "s",
          latency_quantiles("gen_ai_client_operation_duration_seconds", "gen_ai_operation_name", _M, (0.5, 0.95))),
))

BOARD = Board(
    uid="kvmesh-fleet",
    title="kvmesh / Fleet overview",
    description="What clients get: requests, TTFT / ITL / end-to-end by priority class, tokens, refusals.",
    rows=(_traffic, _latency, _refusals, _genai),
)
