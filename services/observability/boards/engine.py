"""Engine board, one series per engine: KV blocks, running and waiting,
step time, preemptions, health, tokens, and the request phases (vLLM's
names, so a vLLM engine and a kvmesh engine read the same)."""

from __future__ import annotations

from services.observability.panels import Board, Panel, Query, Row, latency_quantiles, rate

__all__ = ["BOARD"]

_E = 'model_name=~"$model", engine=~"$engine"'

_capacity = Row("KV cache and batch", (
    Panel("KV blocks by state", "short", (
        Query(f"sum by (engine, state) (kvmesh_engine_kv_blocks{{{_E}}})", "{{engine}} {{state}}"),
    ), "used = held by running requests, cached = free but holding a reusable prefix, total."),
    Panel("KV cache usage", "percentunit", (
        Query(f"max by (engine) (vllm:kv_cache_usage_perc{{{_E}}})", "{{engine}}"),
    )),
    Panel("Running and waiting", "short", (
        Query(f"sum by (engine) (vllm:num_requests_running{{{_E}}})", "running {{engine}}"),
        Query(f"sum by (engine) (vllm:num_requests_waiting{{{_E}}})", "waiting {{engine}}"),
    )),
    Panel("Step time", "s", latency_quantiles("kvmesh_engine_step_seconds", "engine", _E, (0.5, 0.99)),
          "One backend step (one batch iteration)."),
    Panel("Tokens per step", "short", latency_quantiles("vllm:iteration_tokens_total", "engine", _E, (0.5, 0.99))),
    Panel("Batch gate", "short", (
        Query(f"sum by (engine) (kvmesh_engine_runtime_waiting{{{_E}}})", "held {{engine}}"),
        Query(f"sum by (engine) (kvmesh_engine_p0_headroom_in_use{{{_E}}})", "P0 headroom {{engine}}"),
    ), "Requests held back from the backend, and P0s beyond max_running."),
))

_health = Row("Health and movement", (
    Panel("Serving", "short", (
        Query(f"max by (engine) (kvmesh_engine_serving{{{_E}}})", "{{engine}}"),
    ), "1 = the engine takes work (reported by the engine).", kind="stat"),
    Panel("Serving, as the scheduler sees it", "short", (
        Query('max by (engine) (kvmesh_scheduler_engine_serving{model_name=~"$model", engine=~"$engine"})',
              "{{engine}}"),
    ), kind="stat"),
    Panel("Flaps in the last hour", "short", (
        Query('max by (engine) (increase(kvmesh_scheduler_engine_flaps_total{engine=~"$engine"}[1h]))',
              "{{engine}}"),
    ), "Serving <-> not serving transitions.", kind="stat"),
    Panel("Preemptions and migrations out / s", "ops", (
        Query(rate("vllm:num_preemptions_total", "engine", _E), "preempted {{engine}}"),
        Query(rate("kvmesh_engine_migrations_out_total", "engine", _E), "migrated out {{engine}}"),
        Query(rate("kvmesh_engine_p0_over_admissions_total", "engine", _E), "P0 over max_running {{engine}}"),
    )),
    Panel("Finished / s by reason", "ops", (
        Query(rate("vllm:request_success_total", "finished_reason", _E), "{{finished_reason}}"),
    )),
))

_requests = Row("Tokens and request phases", (
    Panel("Tokens / s", "short", (
        Query(rate("vllm:prompt_tokens_total", "engine", _E), "prompt {{engine}}"),
        Query(rate("vllm:generation_tokens_total", "engine", _E), "generated {{engine}}"),
    )),
    Panel("Prefix cache hit rate", "percentunit", (
        Query(f"{rate('vllm:prefix_cache_hits_total', 'engine', _E)} / "
              f"{rate('vllm:prefix_cache_queries_total', 'engine', _E)}", "{{engine}}"),
    )),
    Panel("Time to first token (engine)", "s",
          latency_quantiles("vllm:time_to_first_token_seconds", "engine", _E, (0.5, 0.99))),
    Panel("Inter-token latency (engine)", "s",
          latency_quantiles("vllm:inter_token_latency_seconds", "engine", _E, (0.5, 0.99))),
    Panel("Request phases p95", "s", (
        Query(f"histogram_quantile(0.95, sum by (le) (rate(vllm:request_queue_time_seconds_bucket{{{_E}}}"
              "[$__rate_interval])))", "queue"),
        Query(f"histogram_quantile(0.95, sum by (le) (rate(vllm:request_prefill_time_seconds_bucket{{{_E}}}"
              "[$__rate_interval])))", "prefill"),
        Query(f"histogram_quantile(0.95, sum by (le) (rate(vllm:request_decode_time_seconds_bucket{{{_E}}}"
              "[$__rate_interval])))", "decode"),
    )),
    Panel("End-to-end (engine)", "s",
          latency_quantiles("vllm:e2e_request_latency_seconds", "engine", _E, (0.5, 0.99))),
))

BOARD = Board(
    uid="kvmesh-engine",
    title="kvmesh / Engines",
    description="Per engine: KV blocks, running and waiting, step time, preemptions, health, tokens.",
    rows=(_capacity, _health, _requests),
    variables=("model", "engine"),
)
