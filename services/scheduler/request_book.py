"""Every admitted request's record, its lease, and its one finish.

Ownership rule: `RequestBook` is owned by `SchedulerCore` and called only
from it (so only from the core's one thread, see core.py). It is the only
code that opens or ends a request's lease and the only code that finalises
a request: `finish` is idempotent, and every exit path (done, withdraw,
reject, expiry) goes through it, so each request is counted exactly once.
"""

from __future__ import annotations

from collections.abc import Iterator

from .engine_registry import EngineRecord
from .fleet import EngineFleet
from .metrics import SchedulerMetrics
from .records import Lease, Outcome, RejectedInfo, RejectReason, RequestRecord, RequestState
from .waiting import WaitingRoom

__all__ = ["RequestBook"]


class RequestBook:
    def __init__(self, fleet: EngineFleet, waiting: WaitingRoom, metrics: SchedulerMetrics) -> None:
        self._fleet = fleet
        self._waiting = waiting
        self._metrics = metrics
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
        self, rec: RequestRecord, engine: EngineRecord, reserved: int, cached: int, now: float
    ) -> Lease:
        rec.lease = self._fleet.open_lease(
            rec.options.request_id, engine, reserved, cached, rec.options.prompt_tokens, now)
        rec.state = RequestState.PLACED
        self._metrics.leases.set(self._fleet.lease_count())
        return rec.lease

    def end_lease(self, rec: RequestRecord, now: float) -> None:
        lease, rec.lease = rec.lease, None
        if lease is not None:
            self._fleet.close_lease(lease, now)
            self._metrics.leases.set(self._fleet.lease_count())

    def orphan(self, ended: list[Lease]) -> None:
        """These leases' engine went away: their requests wait ORPHANED for
        the gateway to Replace or leave."""
        for lease in ended:
            rec = self._records.get(lease.request_id)
            if rec is not None and rec.lease is lease:
                rec.lease = None
                rec.state = RequestState.ORPHANED

    def finish(self, rec: RequestRecord, outcome: Outcome, now: float) -> None:
        """Finalise a request exactly once, from whatever state it is in."""
        if rec.state is RequestState.FINISHED:
            return
        self._waiting.remove(rec, queued=rec.state is RequestState.QUEUED)
        self.end_lease(rec, now)
        rec.state = RequestState.FINISHED
        rec.entry = None
        self._records.pop(rec.options.request_id, None)
        self._metrics.finished.labels(outcome.value).inc()

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
