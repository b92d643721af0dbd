"""Gateway / edge board: the gateways' streams (open, heartbeats, slow
readers and pacing, drains, resumes) and Envoy in front of them (upstream
health, responses by class, latency). Envoy's names are those of its admin
`/stats/prometheus` (counters without `_total`)."""

from __future__ import annotations

from services.observability.panels import Board, Panel, Query, Row, rate

__all__ = ["BOARD"]

# The public listener's connection manager (stat prefix `edge`): not the
# admin interface's, nor the Kubernetes stats listener's (`stats`, scrapes).
_EDGE = 'envoy_http_conn_manager_prefix="edge"'

_streams = Row("Gateway streams", (
    Panel("Open streams per gateway", "short", (
        Query("sum by (instance) (kvmesh_gateway_active_streams)", "{{instance}}"),
    )),
    Panel("Heartbeats / s", "ops", (Query(rate("kvmesh_gateway_heartbeats_total"), "heartbeats"),),
          "Keep-alive comments sent on idle streams."),
    Panel("Slow readers and paced streams", "short", (
        Query("sum(kvmesh_gateway_paced_streams)", "paced now"),
        Query("sum(increase(kvmesh_gateway_slow_readers_total[$__rate_interval]))", "slow readers"),
    ), "Streams paced for a client that reads slower than tokens arrive."),
    Panel("Resumes / s by result", "ops", (Query(rate("kvmesh_gateway_resumes_total", "result"), "{{result}}"),)),
    Panel("Draining", "short", (
        Query("sum(kvmesh_gateway_draining)", "draining gateways"),
        Query("sum(increase(kvmesh_gateway_drain_cut_total[1h]))", "streams cut at the drain bound (1h)"),
    ), kind="stat"),
    Panel("Gateway responses / s by route and status", "reqps", (
        Query(rate("kvmesh_gateway_requests_total", "route, status"), "{{route}} {{status}}"),
    )),
    Panel("Re-admissions after a scheduler restart", "ops", (
        Query(rate("kvmesh_gateway_scheduler_readmissions_total", "state"), "{{state}}"),
    )),
))

_envoy = Row("Envoy", (
    Panel("Healthy gateways (Envoy's view)", "short", (
        Query("sum by (envoy_cluster_name) (envoy_cluster_membership_healthy)", "healthy {{envoy_cluster_name}}"),
        Query("sum by (envoy_cluster_name) (envoy_cluster_membership_total)", "total {{envoy_cluster_name}}"),
    ), "Upstream hosts passing Envoy's health checks, per cluster."),
    Panel("Downstream responses / s by class", "reqps", (
        Query(rate("envoy_http_downstream_rq_xx", "envoy_response_code_class", _EDGE),
              "{{envoy_response_code_class}}xx"),
    ), "What clients got from Envoy (4xx/5xx include refusals by the gateways)."),
    Panel("Upstream responses / s by cluster and class", "reqps", (
        Query(rate("envoy_cluster_upstream_rq_xx", "envoy_cluster_name, envoy_response_code_class"),
              "{{envoy_cluster_name}} {{envoy_response_code_class}}xx"),
    )),
    Panel("Active downstream requests and connections", "short", (
        Query(f"sum(envoy_http_downstream_rq_active{{{_EDGE}}})", "requests"),
        Query(f"sum(envoy_http_downstream_cx_active{{{_EDGE}}})", "connections"),
    )),
    Panel("Upstream request time p99", "ms", (
        Query("histogram_quantile(0.99, sum by (le, envoy_cluster_name) "
              "(rate(envoy_cluster_upstream_rq_time_bucket[$__rate_interval])))", "{{envoy_cluster_name}}"),
    ), "Whole streams, so long generations dominate."),
    Panel("Health-check failures and timeouts / s", "ops", (
        Query(rate("envoy_cluster_health_check_failure", "envoy_cluster_name"), "hc failed {{envoy_cluster_name}}"),
        Query(rate("envoy_cluster_upstream_rq_timeout", "envoy_cluster_name"), "timeout {{envoy_cluster_name}}"),
    )),
))

BOARD = Board(
    uid="kvmesh-edge",
    title="kvmesh / Gateways and edge",
    description="Open streams, heartbeats, slow readers, drains and resumes; Envoy's upstream health and 4xx/5xx.",
    rows=(_streams, _envoy),
    variables=(),
)
