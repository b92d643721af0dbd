"""The admit phase: a request's first answer -- Queued, Placed (re-attach or
a copy leased beside its twin) or Rejected.

Checks (admission_limits.py), the TTL (deadlines.py), the aging class
(aging.py), queue room by its class's rules (classes.py; at a tenant's cap
the displacement of its lowest class, making_room.py), then into its model's
queue (waiting.py, queue.py).

Ownership rule: `Admission` is owned by `SchedulerCore` and called only from
its `handle` (the core's one thread, see core.py); it changes requests and
leases only through `RequestBook`.
"""

from __future__ import annotations

from .admission_limits import validate_options
from .core_parts import CoreParts
from .detached_leases import DetachedLeases
from .events import Delivery
from .records import (
    AdmissionError,
    AdmitOptions,
    Notice,
    PlacedInfo,
    QueuedInfo,
    QueueEntry,
    RejectReason,
    RequestRecord,
    RequestState,
)

__all__ = ["Admission", "queued_info"]


def queued_info(position: int, cls: int, rate: float) -> QueuedInfo:
    """A Queued notice: its position and Little's law's wait estimate."""
    return QueuedInfo(position, (position + 1) / rate if rate > 0 else 0.0, cls)


class Admission:
    def __init__(self, parts: CoreParts, detached: DetachedLeases) -> None:
        self._p = parts
        self._detached = detached
        self.shutting_down = False

    def admit(self, options: AdmitOptions, now: float, displaced: list[Delivery]) -> Notice:
        """Admit one request (requests it displaced into `displaced`);
        raises the AdmissionError that refuses it."""
        p = self._p
        validate_options(options)
        if options.resume:
            return self._detached.resume(options, now)
        if options.request_id in p.requests:
            raise AdmissionError(
                RejectReason.INVALID,
                f"request_id {options.request_id!r} is already admitted on another stream; "
                "use a fresh id",
            )
        if self.shutting_down:
            raise AdmissionError(
                RejectReason.DRAINING, "the scheduler is shutting down; retry shortly", p.limits.retry_min,
            )
        if options.running_on_engine:
            placed = self._reattach(options, now)
            if placed is not None:
                return placed
        # together skips the slot filters: only for a class that may fill every slot
        if options.together_with and p.classes[options.klass].reserved_slots:
            placed = self._together(options, now)
            if placed is not None:
                return placed
        return self._queue(options, now, displaced)

    def _queue(self, options: AdmitOptions, now: float, displaced: list[Delivery]) -> Notice:
        p = self._p
        arrival = self._arrival(options, now)
        p.fleet.check_servable(options, frozenset(), now, arrival=arrival)
        expires_at, ttl_reason = p.deadlines.queue_expiry(
            options, p.limits.expires_at(options, arrival, now - p.clock.wall()), arrival, now)
        if p.config.scaling.enabled and not p.fleet.serves(options.model):
            # Scale from zero: its wait for an engine to start is the bound, whatever its class's TTL.
            expires_at = max(expires_at, p.fleet.cold_start_deadline(arrival))
            ttl_reason = f"{ttl_reason}, or the wait for an engine to start (scheduler.scaling)"
        if now >= expires_at:
            raise AdmissionError(RejectReason.EXPIRED, f"the request waited {now - arrival:.1f} s, past the "
                                 f"P{options.priority} queue-wait deadline, {ttl_reason}",
                                 p.retry_after_for(options.priority))
        cls_now = p.aging.class_at(options.priority, arrival, now)
        rate = p.rate.rate(now)
        displaced.extend(p.room.admit_room(options, cls_now, rate, now))
        entry = QueueEntry(
            options=options, seq=next(p.seq), arrival=arrival,
            base_class=options.priority, cls=options.priority, expires_at=expires_at, ttl_reason=ttl_reason,
        )
        queue = p.waiting.queue(options.model)
        p.metrics.count_promotions(queue.push(entry, now))
        p.requests.add(RequestRecord(options, RequestState.QUEUED, entry=entry, arrival=arrival))
        p.metrics.child(p.metrics.admissions, p.classes[options.klass].label).inc()
        return queued_info(queue.position_of(entry), entry.cls, rate)

    def _arrival(self, options: AdmitOptions, now: float) -> float:
        """Monotonic arrival; a re-admitted request keeps its original time."""
        if options.arrival_unix <= 0:
            return now
        waited = max(0.0, self._p.clock.wall() - options.arrival_unix)
        return now - waited

    def _reattach(self, options: AdmitOptions, now: float) -> PlacedInfo | None:
        """Soft state after a scheduler restart: the request runs on a known
        engine already, so lease it there without queueing or reserving."""
        p = self._p
        record = p.fleet.get(options.running_on_engine)
        if record is None or record.info.model != options.model:
            return None
        rec = RequestRecord(options, RequestState.PLACED, arrival=now)
        p.requests.add(rec)
        lease = p.requests.open_lease(rec, record, reserved=0, cached=0, now=now)
        p.metrics.placed(p.room.policy.name, "reattach", 0, 0)
        return PlacedInfo(record.engine_id, record.info.address, lease.lease_id, 0, record.info.incarnation)

    def _together(self, options: AdmitOptions, now: float) -> PlacedInfo | None:
        """A copy of a running request (a choice of n > 1): leased on that
        request's engine now, reserving blocks for its own decode, so the copies
        share the prompt's KV there. None (queue as usual) if that request holds
        no lease, is another tenant's or its engine no longer serves."""
        p = self._p
        twin = p.requests.get(options.together_with)
        if twin is None or twin.lease is None or twin.options.tenant != options.tenant:
            return None
        record = p.fleet.get(twin.lease.engine_id)
        if record is None or record.info.model != options.model or not p.fleet.takes_work(record):
            return None
        rec = RequestRecord(options, RequestState.PLACED, arrival=now)
        p.requests.add(rec)
        reserved = -(-options.max_tokens // max(1, record.info.block_size))
        lease = p.requests.open_lease(rec, record, reserved=reserved, cached=options.prompt_tokens, now=now)
        p.metrics.placed(p.room.policy.name, "together", options.prompt_tokens, options.prompt_tokens)
        return PlacedInfo(record.engine_id, record.info.address, lease.lease_id, options.prompt_tokens,
                          record.info.incarnation)
