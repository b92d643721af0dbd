"""The metric catalogue lists what each service's real metric classes
register, as families and as exposition sample names."""

from __future__ import annotations

from services.gateway.metrics import GatewayMetrics
from services.observability.metric_catalogue import SERVICES, exported_metric_families, exported_metric_names

# The issue-17 contract (BRIEF17 "Shared contract"), by the names a query uses.
CONTRACT = {
    "gateway": {
        "kvmesh_gateway_time_to_first_token_seconds_bucket", "kvmesh_gateway_inter_token_latency_seconds_bucket",
        "kvmesh_gateway_e2e_request_latency_seconds_bucket", "kvmesh_gateway_prompt_tokens_total",
        "kvmesh_gateway_generation_tokens_total", "kvmesh_gateway_rejections_total", "kvmesh_gateway_resumes_total",
        "kvmesh_gateway_heartbeats_total", "kvmesh_gateway_paced_streams", "kvmesh_gateway_slow_readers_total",
        "gen_ai_server_time_to_first_token_seconds_bucket", "gen_ai_server_time_per_output_token_seconds_bucket",
        "gen_ai_server_request_duration_seconds_bucket", "gen_ai_client_token_usage_bucket",
        "gen_ai_client_operation_duration_seconds_bucket", "inference_objective_request_total",
        "inference_objective_request_error_total", "inference_objective_request_duration_seconds_bucket",
        "inference_objective_input_tokens_bucket", "inference_objective_output_tokens_bucket",
        "inference_objective_running_requests",
        # issue 18: the response cache
        "kvmesh_gateway_response_cache_hits_total", "kvmesh_gateway_response_cache_misses_total",
        "kvmesh_gateway_response_cache_stores_total", "kvmesh_gateway_response_cache_evictions_total",
        "kvmesh_gateway_response_cache_errors_total", "kvmesh_gateway_response_cache_bytes",
    },
    "scheduler": {
        "kvmesh_scheduler_decision_seconds_bucket", "kvmesh_scheduler_reported_prefix_hit_rate",
        "kvmesh_scheduler_oldest_wait_seconds", "kvmesh_scheduler_aging_bound_seconds",
        "kvmesh_scheduler_engine_serving", "kvmesh_scheduler_engine_flaps_total",
        "kvmesh_scheduler_start_time_seconds", "kvmesh_scheduler_admissions_paused",
        "inference_pool_average_kv_cache_utilization", "inference_pool_average_queue_size",
        "inference_pool_ready_pods",
        # existing ones keep their names
        "kvmesh_scheduler_queue_length", "kvmesh_scheduler_fenced_total", "kvmesh_scheduler_engines_superseded_total",
    },
    "engine": {
        "vllm:num_preemptions_total", "vllm:inter_token_latency_seconds_bucket",
        "vllm:request_queue_time_seconds_bucket", "vllm:request_prefill_time_seconds_bucket",
        "vllm:request_decode_time_seconds_bucket", "vllm:iteration_tokens_total_bucket",
        "kvmesh_engine_step_seconds_bucket", "kvmesh_engine_kv_blocks", "kvmesh_engine_serving",
        "kvmesh_engine_migrations_out_total", "kvmesh_engine_fenced_total", "vllm:num_requests_running",
    },
}


def test_every_contract_name_is_exported() -> None:
    names = exported_metric_names()
    assert set(names) == set(SERVICES)
    for service, wanted in CONTRACT.items():
        assert wanted <= names[service], (service, sorted(wanted - names[service]))


def test_names_follow_the_exposition() -> None:
    names, families = exported_metric_names(), exported_metric_families()
    gateway = names["gateway"]
    assert "kvmesh_gateway_rejections" in families["gateway"] and "kvmesh_gateway_rejections" not in gateway
    assert {"kvmesh_gateway_e2e_request_latency_seconds_" + s for s in ("bucket", "sum", "count")} <= gateway
    assert "kvmesh_gateway_paced_streams_total" not in gateway  # a gauge has no suffix
    assert "kvmesh_gateway_info" in gateway
    # Nothing a service does not export: a made-up name is absent everywhere.
    assert all("kvmesh_gateway_made_up_total" not in n for n in names.values())


def test_catalogue_matches_a_real_exposition() -> None:
    """Every sample in a live registry's text is in the catalogue."""
    metrics = GatewayMetrics()
    metrics.rejected("queue_full")
    metrics.e2e.labels("chat", "P0", "m").observe(0.5)
    exposed = {line.split("{")[0].split(" ")[0] for line in metrics.render().decode().splitlines()
               if line and not line.startswith("#")}
    assert exposed <= exported_metric_names()["gateway"], sorted(exposed - exported_metric_names()["gateway"])
