"""Leases kept after their gateway vanished, for a resume (README "Resuming
a stream").

When a request's Admit stream breaks while it holds a lease (PLACED), its
gateway died or lost its link; the engine keeps the generation detached
(services/engine/detached.py) for the same grace. So does the scheduler:
the record goes DETACHED and keeps its lease -- still leased to that engine
(its capacity stays accounted, engine-side fencing sees it leased, it is
never chosen for preemption: nobody could answer Requeue) -- until
`resume.grace_seconds` pass (then it is finished WITHDRAWN, the lease
released) or a gateway re-admits it with `AdmitRequest.resume`. A resume
must come from the request's own tenant and model; it re-attaches the lease
to the new Admit stream and is answered `Placed` on the engine where the
generation runs. A resume of a request still PLACED (its old gateway has
not noticed a partition yet) takes it over the same way: the transport
(grpc_api.py) ends the old stream and ignores it from then on.

Ownership: `DetachedLeases` is owned by `SchedulerCore` and called only from
it, like the `RequestBook` it acts through.
"""

from __future__ import annotations

import logging

from .fleet import EngineFleet
from .records import (
    AdmissionError,
    AdmitOptions,
    Outcome,
    PlacedInfo,
    RejectReason,
    RequestRecord,
    RequestState,
)
from .request_book import RequestBook

__all__ = ["DetachedLeases"]

log = logging.getLogger(__name__)


class DetachedLeases:
    def __init__(self, book: RequestBook, fleet: EngineFleet, grace_seconds: float) -> None:
        self._book = book
        self._fleet = fleet
        self._grace = grace_seconds
        self._until: dict[str, float] = {}  # request id -> when its lease is released

    def __len__(self) -> int:
        return len(self._until)

    def keep(self, rec: RequestRecord, now: float) -> bool:
        """`rec`'s Admit stream broke: keep its lease DETACHED (True), or
        not (False: the caller finishes it as before)."""
        if self._grace <= 0 or rec.state is not RequestState.PLACED or rec.lease is None:
            return False
        rec.state = RequestState.DETACHED
        self._until[rec.options.request_id] = now + self._grace
        log.info("request %s: its gateway went away; lease on %s kept %.0f s for a resume",
                 rec.options.request_id, rec.lease.engine_id, self._grace)
        return True

    def resume(self, options: AdmitOptions, now: float) -> PlacedInfo:
        """Re-attach a kept (or still placed) lease for `options.resume`."""
        request_id = options.request_id
        rec = self._book.get(request_id)
        lease = rec.lease if rec is not None else None
        engine = self._fleet.get(lease.engine_id) if lease is not None else None
        if rec is None or lease is None or engine is None or rec.state not in (
                RequestState.DETACHED, RequestState.PLACED):
            raise AdmissionError(
                RejectReason.RESUME_UNKNOWN,
                f"no stream {request_id!r} to resume: it finished, expired or never ran")
        if rec.options.tenant != options.tenant or rec.options.model != options.model:
            raise AdmissionError(
                RejectReason.RESUME_FORBIDDEN,
                f"stream {request_id!r} belongs to another tenant or model")
        self._until.pop(request_id, None)
        rec.state = RequestState.PLACED
        log.info("request %s: resumed on %s", request_id, lease.engine_id)
        return PlacedInfo(lease.engine_id, engine.info.address, lease.lease_id, 0, engine.info.incarnation)

    def expire(self, now: float) -> None:
        """Release the leases whose grace ran out (their engine cancels too)."""
        for request_id, until in list(self._until.items()):
            if now < until:
                continue
            del self._until[request_id]
            rec = self._book.get(request_id)
            if rec is not None and rec.state is not RequestState.PLACED:
                log.info("request %s: not resumed in time; lease released", request_id)
                self._book.finish(rec, Outcome.WITHDRAWN, now)
