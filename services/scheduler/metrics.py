"""The scheduler's Prometheus metrics, in their own CollectorRegistry.

Counters are bumped by the core where things happen; gauges are refreshed by
the core's housekeeping tick (from the event loop, never from the metrics
HTTP thread, so the core keeps one owner).
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from services.common.label_cache import LabelCache
from services.common.metric_labels import PRIORITY_LABELS, priority_label

from .queue import Promotion
from .records import RejectReason

__all__ = ["PLACEMENT_KINDS", "SchedulerMetrics"]

# kvmesh_scheduler_placements_total's `kind`: a queued request placed on an
# engine holding its prefix or not, a Replace, a re-attach after a scheduler
# restart, an n > 1 copy joining its twin (dispatch.py, admit.py).
PLACEMENT_KINDS = ("cold", "warm", "replace", "reattach", "together")

# Picking an engine: tens of microseconds (few engines) to milliseconds.
_DECISION_BUCKETS = (0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025,
                     0.05, 0.1)
_WAIT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 900, 3600)


class SchedulerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry or CollectorRegistry()
        self.child = LabelCache()   # child(metric, *labels): kept labels() (label_cache.py)
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
        self._prompt_total = 0
        self._cached_total = 0
        self._add_preemption_metrics(r)
        self._add_peer_metrics(r)
        self._add_fleet_metrics(r)
        self._add_pool_metrics(r)
        self._add_deadline_metrics(r)
        self._zero_known_series()

    def _zero_known_series(self) -> None:
        """Every child whose label values are known before any event, at 0: a
        board or alert reading a counter that does not exist yet sees
        nothing, not 0. (Children keyed by an engine or a model appear with
        them; the policy's with `policy_in_force`.)"""
        for label in PRIORITY_LABELS:
            self.queue_length.labels(label).set(0)
            for metric in (self.queue_wait, self.admissions, self.preemptions, self.requeued, self.displaced):
                metric.labels(label)
        for lower, upper in zip(PRIORITY_LABELS[1:], PRIORITY_LABELS, strict=False):
            self.promotions.labels(lower, upper)   # aging moves a request up one class at a time
        for reason in RejectReason:
            self.rejections.labels(reason.value)
        for state in ("fresh", "stale", "spare"):
            self.engines.labels(state).set(0)
        for outcome in ("held", "expired"):
            self.peer_holds.labels(outcome)

    def policy_in_force(self, policy: str) -> None:
        """The placement policy in use (at start and after an operator's
        change): its placement and decision series exist from now on, at 0."""
        for kind in PLACEMENT_KINDS:
            self.placements.labels(policy, kind)
        self.decision_seconds.labels(policy)

    def _add_peer_metrics(self, r: CollectorRegistry) -> None:
        # Priority across replicas (peer_heads.py): room left to a more urgent
        # request of another replica ("held"), and holds that ran out ("expired").
        self.peer_holds = Counter(
            "kvmesh_scheduler_peer_holds_total",
            "Room this replica left to a more urgent request queued at another replica, by outcome",
            ["outcome"], registry=r,
        )
        self.peers_fresh = Gauge(
            "kvmesh_scheduler_peers_fresh", "Other scheduler replicas heard from within scheduler.peers.stale_seconds",
            registry=r,
        )

    def _add_spare_metrics(self, r: CollectorRegistry) -> None:
        """Warm spares (spares.py); the held count is kvmesh_scheduler_engines{state="spare"}."""
        self.spare_promotions = Counter(
            "kvmesh_scheduler_spare_promotions_total",
            "Warm spares promoted to serving, by model and reason (slo: queued work would miss its "
            "first-token target; fleet: the model's engines fell to the spares held + 1)",
            ["model_name", "reason"], registry=r,
        )
        self.spare_returns = Counter(
            "kvmesh_scheduler_spare_returns_total",
            "Idle engines held as warm spares (at start-up, and after calm)", ["model_name"], registry=r,
        )
        self.spare_promotion_seconds = Histogram(
            "kvmesh_scheduler_spare_promotion_seconds",
            "Seconds from a spare's promotion for queued work (reason slo) to the first placement on it",
            buckets=_WAIT_BUCKETS, registry=r,
        )
        self.spare_first_token_seconds = Histogram(
            "kvmesh_scheduler_spare_first_token_seconds",
            "Seconds from a spare's promotion for queued work (reason slo) to the first token of a "
            "request placed on it",
            buckets=_WAIT_BUCKETS, registry=r,
        )

    def _add_deadline_metrics(self, r: CollectorRegistry) -> None:
        """The deadline book's values (deadlines.py), refreshed by the tick."""
        self.deadline_seconds = Gauge(
            "kvmesh_scheduler_deadline_seconds",
            "Deadline in force: clamp(multiple x p95, floor, ceiling), or the ceiling until enough samples",
            ["kind", "model_name", "priority"], registry=r,
        )
        self.latency_p95_seconds = Gauge(
            "kvmesh_scheduler_latency_p95_seconds",
            "p95 of the live latency window each deadline comes from (0 = no samples; generation: the "
            "estimate p95 first token + max_tokens x p95 gap for a 256-token request)",
            ["kind", "model_name", "priority"], registry=r,
        )

    def _add_fleet_metrics(self, r: CollectorRegistry) -> None:
        """Decision latency, engines serving and flapping, queue age against
        the aging bound, the engines' own prefix hit rates, restarts."""
        self.decision_seconds = Histogram(
            "kvmesh_scheduler_decision_seconds", "Time to pick an engine for one request (the policy's "
            "filters, scorers and picker), by policy", ["policy"], buckets=_DECISION_BUCKETS, registry=r,
        )
        self.reported_prefix_hit_rate = Gauge(
            "kvmesh_scheduler_reported_prefix_hit_rate", "Prefix-cache hit rate each engine reports (cached / "
            "looked-up prompt tokens since it started), beside kvmesh_scheduler_estimated_prefix_hit_rate",
            ["engine"], registry=r,
        )
        self.oldest_wait = Gauge(
            "kvmesh_scheduler_oldest_wait_seconds", "Age of the oldest queued request, by the class it waits in "
            "now (0 = none queued)", ["priority"], registry=r,
        )
        self.aging_bound = Gauge(
            "kvmesh_scheduler_aging_bound_seconds", "Configured wait after which a queued request moves up a "
            "class (scheduler.aging_seconds), by class (0 = P0, which has no class above)", ["priority"],
            registry=r,
        )
        self.engine_serving = Gauge(
            "kvmesh_scheduler_engine_serving", "1 while a registered engine takes placements (reporting fresh "
            "load, not draining), else 0", ["engine", "model_name"], registry=r,
        )
        self.engine_flaps = Counter(
            "kvmesh_scheduler_engine_flaps", "Transitions of an engine between serving and not serving (either "
            "way, registration and loss included)", ["engine"], registry=r,
        )
        # The scaling policy's answer (services/scheduler/scaling/): a contract
        # -- KEDA's ScaledObject scales an engine workload on
        # max(kvmesh_scheduler_desired_engines{model="..."}), AverageValue 1.
        self.desired_engines = Gauge(
            "kvmesh_scheduler_desired_engines", "Engines the scaling policy wants for the model: serving plus warm "
            "spares, within scheduler.scaling min/max_engines", ["model"], registry=r,
        )
        self.start_time = Gauge(
            "kvmesh_scheduler_start_time_seconds", "Unix time the scheduler process started (its changes() are "
            "restarts)", registry=r,
        )
        self.start_time.set(time.time())
        self.admissions_paused = Gauge(
            "kvmesh_scheduler_admissions_paused",
            "1 while an operator has paused dispatch of the class (kvmesh admin pause)",
            ["priority"], registry=r,
        )
        for label in PRIORITY_LABELS:
            self.admissions_paused.labels(label).set(0)
        self.fenced = Counter(
            "kvmesh_scheduler_fenced", "Generations engines were told to end: not leased to them.",
            ["engine"], registry=r)
        self.superseded = Counter(
            "kvmesh_scheduler_engines_superseded",
            "Engine registrations ended because a newer process of the same engine id said hello "
            "(a restarted or rescheduled engine; or two engines sharing an id).", registry=r)
        self._add_spare_metrics(r)

    def _add_pool_metrics(self, r: CollectorRegistry) -> None:
        """The Gateway API Inference Extension's pool gauges (its EPP's names),
        one pool per model: `name` = the model."""
        self.pool_kv_utilization = Gauge(
            "inference_pool_average_kv_cache_utilization", "GIE: mean KV-cache utilization (0..1) of the "
            "model's serving engines", ["name"], registry=r,
        )
        self.pool_queue_size = Gauge(
            "inference_pool_average_queue_size", "GIE: mean requests waiting per serving engine of the model "
            "(the engines' own queues)", ["name"], registry=r,
        )
        self.pool_ready_pods = Gauge(
            "inference_pool_ready_pods", "GIE: engines serving the model", ["name"], registry=r,
        )

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
        self.batch_queued = Gauge(
            "kvmesh_scheduler_batch_queued",
            "Batch API lines queued (all models), counted against scheduler.batch_queue_cap", registry=r,
        )
        self.batch_preemptions = Counter(
            "kvmesh_scheduler_batch_preemptions_total",
            "Batch API lines whose lease went to a higher class (also in kvmesh_scheduler_preemptions_total)",
            registry=r,
        )

    def placed(self, policy: str, kind: str, prompt_tokens: int, cached_tokens: int) -> None:
        child = self.child
        child(self.placements, policy, kind).inc()
        child(self.prompt_tokens, policy).inc(prompt_tokens)
        child(self.expected_cached_tokens, policy).inc(cached_tokens)
        self._prompt_total += prompt_tokens
        self._cached_total += cached_tokens
        if self._prompt_total:
            self.prefix_hit_rate.set(self._cached_total / self._prompt_total)

    def count_promotions(self, promotions: Iterable[Promotion]) -> None:
        """Aging promotions, by the classes a request left and entered."""
        for p in promotions:
            self.promotions.labels(priority_label(p.from_class), priority_label(p.to_class)).inc()

    def value(self, name: str, labels: dict[str, str] | None = None) -> float:
        """A sample's current value (tests, GetState); 0.0 if absent."""
        result = self.registry.get_sample_value(name, labels or {})
        return 0.0 if result is None else result
