"""Per-class preemption and displacement accounting: the numbers GetState
shows in `SchedulerState.classes` and the Prometheus metrics behind them,
kept in step by one object.

Every count is by the request's ADMITTED class (its `priority`), which never
changes, so a request's preemption, requeue and next placement land in the
same row however far aging moved it.

Ownership rule: `ClassLedger` is owned by `SchedulerCore` and called only
from the core's thread (core.py and request_book.py, which it calls).
"""

from __future__ import annotations

from dataclasses import dataclass

from services.common.metric_labels import priority_label

from .classes import ClassRules
from .metrics import SchedulerMetrics
from .records import NUM_CLASSES

__all__ = ["ClassLedger", "ClassStat"]


@dataclass
class ClassStat:
    """One class's counters since the scheduler started (GetState's ClassState)."""

    priority: int
    preemptions: int = 0       # running requests of this class preempted
    requeued: int = 0          # preempted requests back in the queue
    preempted_now: int = 0     # preempted and not placed again yet
    seconds_lost: float = 0.0  # summed time from preemption to the next placement
    displaced: int = 0         # queued requests refused for a higher class of their tenant
    protected: int = 0         # requests that reached the preemption bound
    # Of `preemptions`, those of a class shown apart (classes.py,
    # ClassRules.apart: batch lines; never protected).
    batch_preemptions: int = 0


class ClassLedger:
    def __init__(self, metrics: SchedulerMetrics) -> None:
        self._metrics = metrics
        self._stats = [ClassStat(c) for c in range(NUM_CLASSES)]

    def preempted(self, rules: ClassRules, reached_bound: bool) -> None:
        """A request of class `rules` lost its lease (counted in its rank's row)."""
        s = self._stats[rules.rank]
        s.preemptions += 1
        if rules.apart:
            s.batch_preemptions += 1
            self._metrics.batch_preemptions.inc()
        s.preempted_now += 1
        label = rules.label
        self._metrics.preemptions.labels(label).inc()
        self._metrics.preempted_now.labels(label).set(s.preempted_now)
        if reached_bound:
            s.protected += 1
            self._metrics.protected.labels(label).inc()

    def requeued(self, cls: int) -> None:
        self._stats[cls].requeued += 1
        self._metrics.requeued.labels(priority_label(cls)).inc()

    def resumed(self, cls: int, seconds_lost: float) -> None:
        """A preempted request is placed again after `seconds_lost`."""
        s = self._stats[cls]
        s.seconds_lost += seconds_lost
        self._metrics.preempted_seconds.labels(priority_label(cls)).observe(seconds_lost)
        self._left(s)

    def abandoned(self, cls: int) -> None:
        """A preempted request finished before it was placed again."""
        self._left(self._stats[cls])

    def _left(self, s: ClassStat) -> None:
        s.preempted_now = max(0, s.preempted_now - 1)
        self._metrics.preempted_now.labels(priority_label(s.priority)).set(s.preempted_now)

    def displaced(self, cls: int) -> None:
        self._stats[cls].displaced += 1
        self._metrics.displaced.labels(priority_label(cls)).inc()

    def snapshot(self) -> list[ClassStat]:
        return [ClassStat(**vars(s)) for s in self._stats]
