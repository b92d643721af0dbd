"""The scheduler's Prometheus metrics, in their own CollectorRegistry.

Counters are bumped by the core where things happen; gauges are refreshed by
the core's housekeeping tick (from the event loop, never from the metrics
HTTP thread, so the core keeps one owner).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

__all__ = ["SchedulerMetrics"]

_WAIT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 900, 3600)


class SchedulerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.queue_length = Gauge(
            "kvmesh_scheduler_queue_length", "Requests queued, by class waited in now",
            ["priority"], registry=r,
        )
        self.queue_wait = Histogram(
            "kvmesh_scheduler_queue_wait_seconds",
            "Seconds from arrival to leaving the queue, by admitted class",
            ["priority"], buckets=_WAIT_BUCKETS, registry=r,
        )
        self.admissions = Counter(
            "kvmesh_scheduler_admissions_total", "Requests admitted to a queue", ["priority"],
            registry=r,
        )
        self.placements = Counter(
            "kvmesh_scheduler_placements_total", "Placements by policy and kind",
            ["policy", "kind"], registry=r,
        )
        self.prompt_tokens = Counter(
            "kvmesh_scheduler_placed_prompt_tokens_total", "Prompt tokens of placed requests",
            ["policy"], registry=r,
        )
        self.expected_cached_tokens = Counter(
            "kvmesh_scheduler_expected_cached_tokens_total",
            "Prompt tokens the index expected cached on the chosen engine",
            ["policy"], registry=r,
        )
        self.prefix_hit_rate = Gauge(
            "kvmesh_scheduler_estimated_prefix_hit_rate",
            "Expected cached prompt tokens / placed prompt tokens since start",
            registry=r,
        )
        self.promotions = Counter(
            "kvmesh_scheduler_promotions_total", "Aging promotions", ["from_priority", "to_priority"],
            registry=r,
        )
        self.rejections = Counter(
            "kvmesh_scheduler_rejections_total", "Rejected requests by reason", ["reason"], registry=r,
        )
        self.finished = Counter(
            "kvmesh_scheduler_requests_finished_total", "Requests leaving the scheduler by outcome",
            ["outcome"], registry=r,
        )
        self.leases = Gauge("kvmesh_scheduler_leases", "Leases held", registry=r)
        self.engines = Gauge(
            "kvmesh_scheduler_engines", "Registered engines by eligibility", ["state"], registry=r,
        )
        self.resyncs = Counter(
            "kvmesh_scheduler_kv_resyncs_total", "Resync requests sent to engines", registry=r,
        )
        self.admissions_paused = Gauge(
            "kvmesh_scheduler_admissions_paused",
            "1 while an operator has paused dispatch of the class (kvmesh admin pause)",
            ["priority"], registry=r,
        )
        self._prompt_total = 0
        self._cached_total = 0
        self._add_preemption_metrics(r)

    def _add_preemption_metrics(self, r: CollectorRegistry) -> None:
        """Per admitted class: preemptions, requeues, displacements, the
        preemption bound reached, time lost, and requests preempted now."""
        self.preemptions = Counter(
            "kvmesh_scheduler_preemptions_total",
            "Running requests whose lease went to a higher class, by admitted class",
            ["priority"], registry=r,
        )
        self.requeued = Counter(
            "kvmesh_scheduler_requeued_total", "Preempted requests queued again, by admitted class",
            ["priority"], registry=r,
        )
        self.displaced = Counter(
            "kvmesh_scheduler_displaced_total",
            "Queued requests refused (429) to make room for a higher class of the same tenant",
            ["priority"], registry=r,
        )
        self.protected = Counter(
            "kvmesh_scheduler_preemption_protected_total",
            "Requests that reached scheduler.max_preemptions (not preempted again)",
            ["priority"], registry=r,
        )
        self.preempted_seconds = Histogram(
            "kvmesh_scheduler_preempted_seconds",
            "Seconds from a preemption to the request's next placement, by admitted class",
            ["priority"], buckets=_WAIT_BUCKETS, registry=r,
        )
        self.preempted_now = Gauge(
            "kvmesh_scheduler_preempted_requests",
            "Requests preempted and not placed again yet, by admitted class",
            ["priority"], registry=r,
        )

    def placed(self, policy: str, kind: str, prompt_tokens: int, cached_tokens: int) -> None:
        self.placements.labels(policy, kind).inc()
        self.prompt_tokens.labels(policy).inc(prompt_tokens)
        self.expected_cached_tokens.labels(policy).inc(cached_tokens)
        self._prompt_total += prompt_tokens
        self._cached_total += cached_tokens
        if self._prompt_total:
            self.prefix_hit_rate.set(self._cached_total / self._prompt_total)

    def value(self, name: str, labels: dict[str, str] | None = None) -> float:
        """A sample's current value (tests, GetState); 0.0 if absent."""
        result = self.registry.get_sample_value(name, labels or {})
        return 0.0 if result is None else result
