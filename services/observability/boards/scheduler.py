"""Scheduler board: queues and waits by class, aging, admissions,
placements by policy, prefix hit rate (estimated vs reported by engines),
decision latency, and the GIE pool gauges."""

from __future__ import annotations

from services.observability.panels import Board, Panel, Query, Row, latency_quantiles, rate

__all__ = ["BOARD"]

_P = 'priority=~"$priority"'

_queues = Row("Queues", (
    Panel("Queue length by class", "short", (
        Query(f"sum by (priority) (kvmesh_scheduler_queue_length{{{_P}}})", "{{priority}}"),
    )),
    Panel("Queue wait by class", "s", latency_quantiles("kvmesh_scheduler_queue_wait_seconds", "priority", _P),
          "Arrival to leaving the queue, by admitted class."),
    Panel("Oldest wait vs aging bound", "s", (
        Query(f"max by (priority) (kvmesh_scheduler_oldest_wait_seconds{{{_P}}})", "oldest {{priority}}"),
        Query(f"max by (priority) (kvmesh_scheduler_aging_bound_seconds{{{_P}}})", "bound {{priority}}"),
    ), "A class whose oldest request nears its bound is about to be promoted: it is not being served."),
    Panel("Admissions / s by class", "ops", (Query(rate("kvmesh_scheduler_admissions_total", "priority", _P),
                                                    "{{priority}}"),)),
    Panel("Aging promotions / s", "ops", (
        Query(rate("kvmesh_scheduler_promotions_total", "from_priority, to_priority"),
              "{{from_priority}} -> {{to_priority}}"),
    )),
    Panel("Admissions paused", "short", (
        Query(f"max by (priority) (kvmesh_scheduler_admissions_paused{{{_P}}})", "{{priority}}"),
    ), "1 = an operator paused admissions of this class (kvmesh admin).", kind="stat"),
))

_placement = Row("Placement", (
    Panel("Placements / s by policy and kind", "ops", (
        Query(rate("kvmesh_scheduler_placements_total", "policy, kind"), "{{policy}} {{kind}}"),
    ), "Warm = on an engine expected to hold the prompt's prefix."),
    Panel("Prefix hit rate: estimated vs engine-reported", "percentunit", (
        Query("max(kvmesh_scheduler_estimated_prefix_hit_rate)", "scheduler estimate"),
        Query('max by (engine) (kvmesh_scheduler_reported_prefix_hit_rate{engine=~"$engine"})',
              "reported {{engine}}"),
        Query('sum(rate(vllm:prefix_cache_hits_total{model_name=~"$model"}[$__rate_interval])) / '
              'sum(rate(vllm:prefix_cache_queries_total{model_name=~"$model"}[$__rate_interval]))',
              "engines (vllm:prefix_cache_*)"),
    )),
    Panel("Decision latency by policy", "s", latency_quantiles("kvmesh_scheduler_decision_seconds", "policy"),
          "Time to pick an engine for one request."),
    Panel("Preemptions, requeues, displacements / s", "ops", (
        Query(rate("kvmesh_scheduler_preemptions_total", "priority", _P), "preempted {{priority}}"),
        Query(rate("kvmesh_scheduler_requeued_total", "priority", _P), "requeued {{priority}}"),
        Query(rate("kvmesh_scheduler_displaced_total", "priority", _P), "displaced {{priority}}"),
    )),
    Panel("Leases and engines", "short", (
        Query("sum(kvmesh_scheduler_leases)", "leases"),
        Query("max by (state) (kvmesh_scheduler_engines)", "engines {{state}}"),
    )),
    Panel("Rejections / s by reason", "ops", (Query(rate("kvmesh_scheduler_rejections_total", "reason"),
                                                     "{{reason}}"),)),
    Panel("Warm spares: promotions and returns / s", "ops", (
        Query(rate("kvmesh_scheduler_spare_promotions_total", "model_name, reason"),
              "promoted {{model_name}} ({{reason}})"),
        Query(rate("kvmesh_scheduler_spare_returns_total", "model_name"), "returned {{model_name}}"),
    ), "scheduler.spares: a spare is promoted when queued P0/P1 work would miss its first-token target "
       "(slo) or an engine left (fleet); an idle engine returns after calm. Held now: "
       "kvmesh_scheduler_engines{state=\"spare\"} in \"Leases and engines\"."),
    Panel("Warm spare promotion to first token", "s",
          latency_quantiles("kvmesh_scheduler_spare_first_token_seconds", ""),
          "From the promotion decision to the first token of a request placed on the promoted engine."),
))

_pool = Row("Pool (Gateway API Inference Extension) and process", (
    Panel("Average KV cache utilization", "percentunit", (
        Query('max by (name) (inference_pool_average_kv_cache_utilization{name=~"$model"})', "{{name}}"),
    )),
    Panel("Average queue size", "short", (
        Query('max by (name) (inference_pool_average_queue_size{name=~"$model"})', "{{name}}"),
    )),
    Panel("Ready engines", "short", (
        Query('max by (name) (inference_pool_ready_pods{name=~"$model"})', "{{name}}"),
    ), kind="stat"),
    Panel("Scheduler uptime", "s", (
        Query("time() - max(kvmesh_scheduler_start_time_seconds)", "uptime"),
    ), "Restarts show as a drop to zero (alert KvmeshSchedulerRestarted).", kind="stat"),
))

BOARD = Board(
    uid="kvmesh-scheduler",
    title="kvmesh / Scheduler",
    description="Queues, aging, admissions, placements, prefix hit rate and decision latency.",
    rows=(_queues, _placement, _pool),
    variables=("model", "engine", "priority"),
)
