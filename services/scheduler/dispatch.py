"""The place and dispatch phases: every waiting request that can be placed
now, per model the Replace lane first, then the class queues in order; and
before that, what time alone changes (aging promotions, TTL expiry).

  place     `_try_place` asks the placement policy (placement/) over the
            fleet's engine views (fleet.py), through batch_yield.py: for a
            class that preempts, yielding classes' slots count as room
            (one yields; classes.py says which class does what);
  preempt   when a queue head of a class that preempts (classes.py,
            ClassTable.preempts: `scheduler.preempt_classes`) cannot be
            placed, `RoomMaker.preempt_for` ends one lower-class,
            unprotected lease (victim rule: preemption.py) and the head is
            placed on that engine in the same dispatch; the victim is told
            Preempted and waits PREEMPTED;
  dispatch  per model the Replace lane, then the queue, in order
            (preempting for a preempt-class head of either), until one
            cannot be placed -- or until room it could take is left to a
            more urgent request another scheduler replica has waiting
            (peer_heads.py: priority across replicas, and its bound);
            leases via the request book.

Ownership rule: `Dispatcher` is owned by `SchedulerCore` and called only
from its `handle` (the core's one thread, see core.py); it changes requests
and leases only through `RequestBook`.
"""

from __future__ import annotations

import time
from collections import OrderedDict

from services.common.metric_labels import priority_label

from .batch_yield import BatchYield
from .core_parts import CoreParts
from .events import Delivery
from .making_room import placement_request
from .queue import ModelQueue
from .records import (
    AdmissionError,
    Notice,
    PlacedInfo,
    PlacementDetail,
    QueueEntry,
    RejectReason,
    RequestRecord,
)

__all__ = ["Dispatcher"]


class Dispatcher:
    def __init__(self, parts: CoreParts, yielder: BatchYield) -> None:
        self._p = parts
        self._yield = yielder
        # Placements carry a PlacementDetail (the request's trace); off = none built.
        self.explain = False

    def dispatch(self) -> list[Delivery]:
        """Place every waiting request that can be placed now: per model, the
        Replace lane first, then the class queues in order. A model stops at
        its first request that cannot be placed (strict priority: smaller
        requests behind it do not overtake it) -- but for a replacement that
        waits for an engine to come back (every engine excluded): no engine
        here may take it, so it holds no one up."""
        if self._p.waiting.idle():
            return []   # nothing waits: aging, TTL and placement have nothing to act on
        now = self._p.clock.monotonic()
        deliveries = self._advance(now)
        for model in self._p.waiting.models():
            deliveries.extend(self._dispatch_model(model, now))
        return deliveries

    def _dispatch_model(self, model: str, now: float) -> list[Delivery]:
        p, out = self._p, list[Delivery]()
        lane = p.waiting.lane(model) or OrderedDict[str, RequestRecord]()
        for rec in list(lane.values()):
            # An engine restarted since is excluded no more; nor, for a request
            # that excludes every engine of its model, one that worked since.
            rec.exclude = p.fleet.exclusions(rec.exclude, rec.ran_on, rec.replaced_at if rec.awaits_engine else None)
            notice = self._place_or_preempt(rec, rec.options.priority, now, out)
            if notice is None:
                if rec.awaits_engine:
                    continue  # no engine here may take it: it competes for no room, holds up no one
                return out
            lane.pop(rec.options.request_id, None)
            out.append((rec.options.request_id, notice))
        queue = p.waiting.existing_queue(model)
        while queue is not None:
            entry = queue.peek()
            if entry is None:
                break
            rec = p.requests[entry.request_id]
            if self._left_to_peer(model, rec, entry, now):
                break
            notice = self._place_or_preempt(rec, entry.cls, now, out, entry, queue)
            if notice is None:
                break
            out.append((entry.request_id, notice))
        return out

    def _left_to_peer(self, model: str, rec: RequestRecord, entry: QueueEntry, now: float) -> bool:
        """Room this replica could fill with `entry` is left to a more urgent
        request another replica has waiting, within the hold's bound
        (peer_heads.py). Without room there is nothing to leave: the head
        waits (or preempts) as it would alone, and no hold starts."""
        found = self._p.peers.outranking(model, entry.cls, now)
        if found is None:
            return False
        request = placement_request(rec, entry.cls, self._p.classes[rec.klass])
        return self._yield.has_room(request, now) and self._p.peers.hold(*found, now)

    def _place_or_preempt(
        self, rec: RequestRecord, cls: int, now: float, out: list[Delivery],
        entry: QueueEntry | None = None, queue: ModelQueue | None = None,
    ) -> Notice | None:
        """`_try_place`; with no room now and its class preempting in rank
        `cls`, preempt one lower-class lease (its Preempted into `out`) and
        place there."""
        notice = self._try_place(rec, now, out, entry, queue)
        if notice is None and self._p.classes.preempts(rec.klass, cls):
            preempted = self._p.room.preempt_for(rec, cls, now)
            if preempted is not None:
                out.append(preempted)
                notice = self._try_place(rec, now, out, entry, queue)
        return notice

    def _try_place(
        self, rec: RequestRecord, now: float, out: list[Delivery],
        entry: QueueEntry | None = None, queue: ModelQueue | None = None,
    ) -> Notice | None:
        """Placed, Rejected (it can never be placed), or None (no room now);
        a batch line it took the room of (batch_yield.py) is Preempted into `out`."""
        p, opts = self._p, rec.options
        cls = entry.cls if entry is not None else opts.priority
        rules, policy = p.classes[rec.klass], p.room.policy
        request, began = placement_request(rec, cls, rules), time.perf_counter()  # decision time: real CPU time
        placement = self._yield.place(request, rules, now, out)
        p.metrics.child(p.metrics.decision_seconds, policy.name).observe(time.perf_counter() - began)
        if placement is None:
            try:
                waits = p.fleet.check_servable(opts, rec.exclude, now, None if entry else rec.replaced_at,
                                               entry.arrival if entry else None)
            except AdmissionError as err:
                if entry is not None and queue is not None:
                    queue.pop(entry)
                return p.requests.reject(rec, now, err.reason, err.message, err.retry_after)
            rec.awaits_engine = waits
            if waits:   # for an engine to come back: its bound, not its class TTL
                rec.replace_expires_at = max(rec.replace_expires_at, p.fleet.return_deadline(rec.replaced_at))
            return None
        waited = 0.0
        if entry is not None and queue is not None:
            queue.pop(entry)
            waited = max(0.0, now - entry.arrival)
            if not entry.resumed:   # a requeued request's wait is kvmesh_scheduler_preempted_seconds
                p.metrics.child(p.metrics.queue_wait, priority_label(entry.base_class)).observe(waited)
                p.deadlines.queued(opts, entry.base_class, waited, now)
        engine = p.fleet.get(placement.view.engine_id)
        if engine is None:  # pragma: no cover - views come from the registry
            raise RuntimeError("placement chose an unknown engine")
        kind = "replace" if entry is None else ("warm" if placement.cached_tokens else "cold")
        rec.entry = None
        lease = p.requests.open_lease(rec, engine, placement.blocks_needed, placement.cached_tokens, now, cls)
        p.rate.record(now)
        p.metrics.placed(policy.name, kind, opts.prompt_tokens, placement.cached_tokens)
        detail = PlacementDetail(policy.name, kind, waited, placement.scored, entry) if self.explain else None
        return PlacedInfo(engine.engine_id, engine.info.address, lease.lease_id, placement.cached_tokens,
                          engine.info.incarnation, detail)

    def _advance(self, now: float) -> list[Delivery]:
        """Aging promotions, then reject whatever waited past its time."""
        p, out = self._p, list[Delivery]()
        expired = p.waiting.advance(now)
        p.metrics.count_promotions(expired.promotions)
        for entry in expired.entries:
            rec = p.requests.get(entry.request_id)
            if rec is not None:
                message = p.deadlines.expired(entry, now)
                out.append((entry.request_id, p.requests.reject(
                    rec, now, RejectReason.EXPIRED, message, p.retry_after_for(entry.cls))))
        for rec in expired.replacements:
            notice = self._expire_replacement(rec, now)
            if notice is not None:
                out.append((rec.options.request_id, notice))
        return out

    def _expire_replacement(self, rec: RequestRecord, now: float) -> Notice | None:
        """Reject a replacement past its time: NO_ENGINE when it waited for an
        engine that did not come back, EXPIRED when engines had no room.
        None: it waits for an engine to come back, whose bound is later."""
        p = self._p
        try:
            if p.fleet.check_servable(rec.options, rec.exclude, now, rec.replaced_at):
                rec.replace_expires_at = max(rec.replace_expires_at, p.fleet.return_deadline(rec.replaced_at))
                if rec.replace_expires_at > now:
                    return None
        except AdmissionError as err:
            return p.requests.reject(rec, now, err.reason, err.message, err.retry_after)
        return p.requests.reject(rec, now, RejectReason.EXPIRED, "no engine had room for the replacement in time",
                                 p.limits.retry_min)
