"""Every admitted request's record, its lease, and its one finish.

Ownership rule: `RequestBook` is owned by `SchedulerCore` and called only
from it (so only from the core's one thread, see core.py). It is the only
code that opens or ends a request's lease (a preemption too: `preempt`
ends it and leaves the record PREEMPTED) and the only code that finalises
a request: `finish` is idempotent, and every exit path (done, withdraw,
reject, expiry) goes through it, so each request is counted exactly once.
"""

from __future__ import annotations

from collections.abc import Iterator

from .class_stats import ClassLedger
from .classes import ClassTable
from .engine_registry import EngineRecord
from .fleet import EngineFleet
from .metrics import SchedulerMetrics
from .records import (
    Lease,
    Outcome,
    PreemptedInfo,
    RejectedInfo,
    RejectReason,
    RequestRecord,
    RequestState,
)
from .waiting import WaitingRoom

__all__ = ["RequestBook"]


class RequestBook:
    def __init__(
        self, fleet: EngineFleet, waiting: WaitingRoom, metrics: SchedulerMetrics,
        ledger: ClassLedger, classes: ClassTable,
    ) -> None:
        self._classes = classes
        self._fleet = fleet
        self._waiting = waiting
        self._metrics = metrics
        self._ledger = ledger
        self._records: dict[str, RequestRecord] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._records

    def __iter__(self) -> Iterator[RequestRecord]:
        return iter(list(self._records.values()))

    def __getitem__(self, request_id: str) -> RequestRecord:
        return self._records[request_id]

    def get(self, request_id: str) -> RequestRecord | None:
        return self._records.get(request_id)

    def add(self, rec: RequestRecord) -> None:
        self._records[rec.options.request_id] = rec

    def open_lease(
        self, rec: RequestRecord, engine: EngineRecord, reserved: int, cached: int, now: float,
        cls: int | None = None,
    ) -> Lease:
        """Lease `engine` in class `cls` (default: the admitted class)."""
        rec.lease = self._fleet.open_lease(
            rec.options, engine, reserved, cached, now, rec.options.priority if cls is None else cls)
        rec.state = RequestState.PLACED
        rec.ran_on[engine.engine_id] = engine.info.incarnation
        if rec.preempted_at is not None:
            self._ledger.resumed(rec.options.priority, max(0.0, now - rec.preempted_at))
            rec.preempted_at = None
        self._metrics.leases.set(self._fleet.lease_count())
        return rec.lease

    def end_lease(self, rec: RequestRecord, now: float) -> None:
        lease, rec.lease = rec.lease, None
        if lease is not None:
            self._fleet.close_lease(lease, now)
            self._metrics.leases.set(self._fleet.lease_count())

    def preempt(self, rec: RequestRecord, by_class: int, bound: int, now: float) -> PreemptedInfo:
        """End a running request's lease for a request of class `by_class`;
        it waits PREEMPTED for the gateway's Requeue. Returns its notice."""
        lease, rec.lease = rec.lease, None
        if lease is None:
            raise RuntimeError(f"preempting {rec.options.request_id}, which holds no lease")
        self._fleet.close_lease(lease, now, preempted=True)
        self._metrics.leases.set(self._fleet.lease_count())
        rec.state = RequestState.PREEMPTED
        rec.preemptions += 1
        rec.preempted_at = now
        rules = self._classes[rec.klass]  # an expendable class is never protected (preemption.py)
        self._ledger.preempted(rules, not rules.expendable and rec.preemptions >= bound)
        return PreemptedInfo(lease.engine_id, rec.preemptions, by_class)

    def orphan(self, ended: list[Lease]) -> None:
        """These leases' engine went away: their requests wait ORPHANED for
        the gateway to Replace or leave."""
        for lease in ended:
            rec = self._records.get(lease.request_id)
            if rec is not None and rec.lease is lease:
                rec.lease = None
                rec.state = RequestState.ORPHANED
                rec.orphaned_from = lease.engine_id

    def finish(self, rec: RequestRecord, outcome: Outcome, now: float) -> None:
        """Finalise a request exactly once, from whatever state it is in."""
        if rec.state is RequestState.FINISHED:
            return
        self._waiting.remove(rec, queued=rec.state is RequestState.QUEUED)
        self.end_lease(rec, now)
        if rec.preempted_at is not None:
            self._ledger.abandoned(rec.options.priority)
            rec.preempted_at = None
        rec.state = RequestState.FINISHED
        rec.entry = None
        self._records.pop(rec.options.request_id, None)
        self._metrics.child(self._metrics.finished, outcome.value).inc()

    def rejected(self, reason: RejectReason, message: str, retry_after: float = 0.0) -> RejectedInfo:
        """The Rejected notice (counted); for a request never admitted."""
        self._metrics.rejections.labels(reason.value).inc()
        return RejectedInfo(reason, message, retry_after)

    def reject(
        self, rec: RequestRecord, now: float, reason: RejectReason, message: str,
        retry_after: float = 0.0,
    ) -> RejectedInfo:
        """Finish an admitted request as rejected; returns its notice."""
        self.finish(rec, Outcome.REJECTED, now)
        return self.rejected(reason, message, retry_after)
