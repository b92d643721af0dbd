"""The scheduler's gauges over its engines and queues, refreshed by the
core's housekeeping tick (the core's one owner, never the metrics thread):

- per engine: `kvmesh_scheduler_engine_serving{engine,model_name}` (serving =
  its last report says SERVING, the report is fresh, not draining),
  `kvmesh_scheduler_engine_flaps_total{engine}` (each change of that, an
  engine lost while serving included; its registration up to its first
  load report is not one),
  `kvmesh_scheduler_reported_prefix_hit_rate{engine}` (hits / lookups the
  engine reports since it started); an engine that left loses its series.
- per model (every configured model, so "none serving" reads 0, not no data):
  the Gateway API Inference Extension's `inference_pool_ready_pods`,
  `inference_pool_average_kv_cache_utilization` and
  `inference_pool_average_queue_size`, over its serving engines.
- per class: `kvmesh_scheduler_oldest_wait_seconds` (arrival to now of the
  oldest request queued in it; classes shown apart -- classes.py,
  ClassRules.apart: batch lines -- left out: they wait hours by design), and
  once `kvmesh_scheduler_aging_bound_seconds`; `kvmesh_scheduler_batch_queued`
  (the classes shown apart).

Cost: a labelled series is written only when its value changed
(`_written`): three label look-ups per engine per tick were ~6% of a core at
1,024 engines and 10 ticks/s. The pass over every engine runs once per
`engine_interval` (1 s: staleness is a matter of seconds, and scrapes come
every 15): at 10 ticks/s it was still ~5% of a core at 1,024 engines, and a
join or a leave refreshed at once, which made registering a fleet
O(engines^2) (13% of the scheduler's CPU while 1,024 engines registered).
Between passes a tick writes the engines `touch`ed since the last one (a
changed report, a drain, a join, a leave) and, when one of those changed
what is serving, the model pools. The queue scan (O(queued)) runs at most
once per `queue_interval` seconds.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Protocol

from services.common.config import SchedulerConfig
from services.common.metric_labels import priority_label

from .aging import AgingRule
from .classes import ClassTable
from .engine_registry import EngineRecord
from .metrics import SchedulerMetrics
from .records import NUM_CLASSES
from .waiting import WaitingRoom

__all__ = ["FleetGauges"]


class Engines(Protocol):
    """The fleet, as the gauges read it (fleet.py's EngineFleet)."""

    def __iter__(self) -> Iterator[EngineRecord]: ...

    def get(self, engine_id: str) -> EngineRecord | None: ...


class FleetGauges:
    def __init__(
        self, metrics: SchedulerMetrics, aging: AgingRule, models: Iterable[str], stale_seconds: float,
        queue_interval: float = 1.0, classes: ClassTable | None = None, engine_interval: float = 1.0,
    ) -> None:
        self._apart = frozenset((classes or ClassTable.from_config(SchedulerConfig())).apart())
        self._metrics = metrics
        self._models = set(models)
        self._stale = stale_seconds
        self._queue_interval = queue_interval
        self._next_queue_scan = float("-inf")
        self._engine_interval = engine_interval
        self._next_engine_pass = float("-inf")
        self._touched: set[str] = set()   # engines whose series may have changed since the last tick
        # engine -> (model, serving); serving None until its first load report
        self._serving: dict[str, tuple[str, bool | None]] = {}
        # engine -> (model, serving, hit rate) as last written to its series
        self._written: dict[str, tuple[str, bool, float]] = {}
        for cls in range(NUM_CLASSES):
            metrics.aging_bound.labels(priority_label(cls)).set(aging.thresholds[cls])
            metrics.oldest_wait.labels(priority_label(cls)).set(0)
        for model in self._models:
            self._set_pool(model, [])

    def touch(self, engine_id: str) -> None:
        """The engine's series may have changed (a changed report, a drain, a
        join, a leave): written at the next tick."""
        self._touched.add(engine_id)

    def refresh(self, engines: Engines, waiting: WaitingRoom, now: float) -> None:
        for cls in range(NUM_CLASSES):
            self._metrics.queue_length.labels(priority_label(cls)).set(waiting.class_len(cls))
        self._metrics.batch_queued.set(sum(waiting.apart_len(k) for k in self._apart))
        if now >= self._next_engine_pass:
            self._next_engine_pass = now + self._engine_interval
            self._engines(list(engines), now)
        elif self._touched:
            self._some(engines, now)
        if now >= self._next_queue_scan:
            self._next_queue_scan = now + self._queue_interval
            self._queues(waiting, now)

    def _engines(self, engines: list[EngineRecord], now: float) -> None:
        """Every engine's series and the pools; the series of engines gone go."""
        self._touched.clear()
        before, self._serving = self._serving, {}
        for e in engines:
            self._engine(e, now, before)
        for engine_id, (model, was_serving) in before.items():
            if engine_id not in self._serving:
                self._gone(engine_id, model, was_serving)
        self._set_pools(engines)

    def _some(self, engines: Engines, now: float) -> None:
        """The touched engines' series; the pools when what serves changed."""
        touched, self._touched = self._touched, set()
        pools = False
        for engine_id in touched:
            e = engines.get(engine_id)
            known = self._serving.get(engine_id)
            if e is None:
                if known is not None:
                    del self._serving[engine_id]
                    self._gone(engine_id, *known)
                    pools = True
                continue
            serving = self._engine(e, now, self._serving)
            pools = pools or known is None or bool(known[1]) != serving
        if pools:
            self._set_pools(engines)

    def _set_pools(self, engines: Iterable[EngineRecord]) -> None:
        """Every model's pool gauges over its engines serving as last written."""
        serving_by_model: dict[str, list[EngineRecord]] = {model: [] for model in self._models}
        for e in engines:
            state = self._serving.get(e.engine_id)
            serving_by_model.setdefault(e.info.model, [])
            if state is not None and state[1]:
                serving_by_model[e.info.model].append(e)
        for model, serving_engines in serving_by_model.items():
            self._set_pool(model, serving_engines)

    def _engine(self, e: EngineRecord, now: float, before: dict[str, tuple[str, bool | None]]) -> bool:
        """One engine's series, its flap counted; whether it serves."""
        m, model = self._metrics, e.info.model
        serving = e.load.serving and not e.draining and e.fresh(now, self._stale)
        was = before.get(e.engine_id, (model, None))[1]
        self._serving[e.engine_id] = (model, serving if e.last_report_at is not None else None)
        if was is not None and was != serving:
            m.engine_flaps.labels(e.engine_id).inc()
        queries = e.load.prefix_cache_queries
        values = (model, serving, e.load.prefix_cache_hits / queries if queries else 0.0)
        if self._written.get(e.engine_id) != values:
            self._write(e.engine_id, values)
        return serving

    def _gone(self, engine_id: str, model: str, was_serving: bool | None) -> None:
        """An engine left (or was superseded): its series go."""
        m = self._metrics
        if was_serving:
            m.engine_flaps.labels(engine_id).inc()
        m.engine_serving.remove(engine_id, model)
        m.reported_prefix_hit_rate.remove(engine_id)
        self._written.pop(engine_id, None)

    def _write(self, engine_id: str, values: tuple[str, bool, float]) -> None:
        m, (model, serving, hit_rate) = self._metrics, values
        if engine_id not in self._written:
            m.engine_flaps.labels(engine_id)  # the series exists at 0, so increase() sees the first flap
        m.engine_serving.labels(engine_id, model).set(1 if serving else 0)
        m.reported_prefix_hit_rate.labels(engine_id).set(hit_rate)
        self._written[engine_id] = values

    def _set_pool(self, model: str, serving: list[EngineRecord]) -> None:
        m, n = self._metrics, len(serving)
        m.pool_ready_pods.labels(model).set(n)
        kv = sum(e.load.blocks_used / e.blocks_total() for e in serving if e.blocks_total())
        m.pool_kv_utilization.labels(model).set(kv / n if n else 0.0)
        m.pool_queue_size.labels(model).set(sum(e.load.waiting for e in serving) / n if n else 0.0)

    def _queues(self, waiting: WaitingRoom, now: float) -> None:
        oldest = [0.0] * NUM_CLASSES
        for stat in waiting.stats(now):
            if stat.klass in self._apart:
                continue
            oldest[stat.priority] = max(oldest[stat.priority], stat.oldest_wait_seconds)
        for cls, seconds in enumerate(oldest):
            self._metrics.oldest_wait.labels(priority_label(cls)).set(seconds)
