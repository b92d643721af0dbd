"""The scheduler core: the one owner of the scheduler's mutable state.

Ownership rule: the core owns all mutable scheduler state, through three objects only it calls: `RequestBook`
(request_book.py: every admitted request's record and lease), `WaitingRoom` (waiting.py: the model queues and
Replace lanes) and `EngineFleet` (fleet.py: the engine registry, KV index, reservations, leases and engine
views), plus the per-class counters of `ClassLedger` (class_stats.py). Helpers it owns act on them only when it
calls: `RoomMaker` (making_room.py: displacement at admission, preemption in dispatch), `Comebacks`
(comebacks.py: Replace and Requeue) and `DetachedLeases` (detached_leases.py: leases kept for a stream resume);
`EngineEvents` (engine_events.py) handles the engines' Connect-stream events, `AdminKnobs` (admin_knobs.py) the
operator's (pause, drain, policy), `DeadlineBook` (deadlines.py) learns deadlines. All of it changes only inside
`SchedulerCore.handle`, called only from the event loop's thread (grpc_api.py and engine_links.py for stream
messages, server.py's timers for `Tick`); synchronous, so no two events interleave and no lock is needed.

One entry point: `handle(event) -> Outbox` applies one event (events.py),
then ALWAYS dispatches (idempotent, cheap when nothing waits: no caller can
strand a placement by forgetting to), and returns everything to deliver. Each request is finalised exactly once, by
`RequestBook.finish` (request_book.py), which every exit path goes through.

Phases of a request and where each lives:
  admit     `_admit` here: checks (admission_limits.py), the aging class
            (aging.py), at a tenant's cap the displacement of its lowest
            class (making_room.py), then into its model's queue
            (waiting.py, queue.py; fairness and ordering from
            queue_policies.py);
  place     `_try_place` here asks the placement policy (placement/) over
            the fleet's engine views (fleet.py), through batch_yield.py: for
            a preempt class, batch lines' slots count as room (one yields);
  preempt   when a queue head of a class in `scheduler.preempt_classes`
            cannot be placed, `RoomMaker.preempt_for` ends one lower-class,
            unprotected lease (victim rule: preemption.py) and the head is
            placed on that engine in the same dispatch; the victim is told
            Preempted and waits PREEMPTED;
  dispatch  `_dispatch` here: per model the Replace lane, then the queue,
            in order (preempting for a preempt-class head of either), until
            one cannot be placed; leases via the fleet;
  requeue   a preempted request's Requeue puts it back in its class queue
            with its original arrival, no TTL (comebacks.py);
  finish    `RequestBook.finish` (request_book.py): out of queue and lane,
            lease ended, counted; idempotent, from any state (PREEMPTED
            included).

Lifecycle (records.RequestState): QUEUED -> PLACED -> FINISHED, with
PLACED -> PREEMPTED -> (Requeue) QUEUED, PLACED -> ORPHANED / REPLACING /
DETACHED -> PLACED, and FINISHED reachable from every state.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from typing import Any

from services.common.clock import Clock
from services.common.config import MeshConfig
from services.common.metric_labels import priority_label

from . import events as ev
from .admin_knobs import AdminKnobs
from .admission_limits import AdmissionLimits, DispatchRateMeter, validate_options
from .aging import AgingRule
from .batch_yield import BatchYield
from .class_stats import ClassLedger, ClassStat
from .comebacks import Comebacks
from .deadlines import DeadlineBook
from .detached_leases import DetachedLeases
from .engine_events import EngineEvents
from .events import Delivery, Outbox
from .fleet import EngineFleet, EngineStat
from .fleet_gauges import FleetGauges
from .making_room import RoomMaker, placement_request
from .metrics import SchedulerMetrics
from .placement import PlacementPolicy, build_policy, builtin_profiles, builtin_registry
from .queue import ModelQueue
from .records import (
    AdmissionError,
    AdmitOptions,
    Lease,
    Notice,
    Outcome,
    PlacedInfo,
    PlacementDetail,
    QueuedInfo,
    QueueEntry,
    RejectReason,
    RequestRecord,
    RequestState,
)
from .request_book import RequestBook
from .state_view import StateView
from .waiting import QueueStat, WaitingRoom

__all__ = ["ClassStat", "EngineStat", "QueueStat", "SchedulerCore", "StateView"]

log = logging.getLogger(__name__)


class SchedulerCore:
    def __init__(
        self, config: MeshConfig, clock: Clock, metrics: SchedulerMetrics | None = None
    ) -> None:
        self._config = config.scheduler
        self._clock = clock
        self.metrics = metrics or SchedulerMetrics()
        self._aging = AgingRule.from_config(self._config.aging)
        self._limits = AdmissionLimits.from_config(self._config)
        self._rate = DispatchRateMeter(self._config.dispatch_rate_window_seconds)
        plugins = self._plugins = builtin_registry(self._config)
        self.policy: PlacementPolicy = build_policy(self._config.policy, self._config, plugins)
        self.waiting = WaitingRoom(self._aging, plugins.make_fairness(self._config.queue_fairness),
                                   plugins.make_ordering(self._config.queue_ordering))
        self.fleet = EngineFleet(self._config, clock.monotonic(), self._limits.retry_min)
        self._seq = itertools.count()
        self._ledger = ClassLedger(self.metrics)
        self.deadlines = DeadlineBook(config, self.metrics)  # deadlines.py: from live p95s
        self._gauges = FleetGauges(self.metrics, self._aging, [m.name for m in config.models],
                                   self._config.stale_report_seconds)
        self._requests = RequestBook(self.fleet, self.waiting, self.metrics, self._ledger)
        self._detached = DetachedLeases(self._requests, self.fleet, config.resume.grace_seconds)
        self._preempt_classes = frozenset(self._config.preempt_classes)
        self._room = RoomMaker(
            self._requests, self.waiting, self.fleet, self.policy, self._limits, self._ledger, config)
        self._yield = BatchYield(self._requests, self.fleet, self._room, config)  # batch lines yield slots
        self._comebacks = Comebacks(
            self._requests, self.waiting, self.fleet, self._limits, self._ledger, self._seq,
            self.metrics.count_promotions)
        self.shutting_down = False
        self._engine_events = EngineEvents(self.fleet, self._requests, self.policy, self.metrics,
                                           self._refresh_gauges, self._config.stale_report_seconds)
        # Placements carry a PlacementDetail (the request's trace); off = none built.
        self.explain = False
        self._handlers: dict[type, Callable[[Any, Outbox, float], None]] = {
            ev.RequestArrived: self._on_arrived, ev.StreamClosed: self._on_closed,
            ev.FirstToken: self._on_first_token, ev.RequestDone: self._on_done,
            ev.ReplaceRequested: self._comebacks.replace,
            ev.RequeueRequested: self._comebacks.requeue,
            ev.Tick: self._on_tick, ev.ShutdownStarted: self._on_shutdown,
            **self._engine_events.handlers(),
            **AdminKnobs(self.waiting, self.fleet, self.metrics, self._use_policy).handlers(),
        }

    # ------------------------------------------------------------ the entry point

    def handle(self, event: ev.Event) -> Outbox:
        """Apply one event, dispatch, and return what to deliver."""
        out = Outbox()
        self._handlers[type(event)](event, out, self._clock.monotonic())
        out.notices.extend(self._dispatch())
        self.deadlines.stamp_all(out.notices, self._requests.get, self._clock.monotonic())
        if isinstance(event, ev.Tick):
            self.waiting.drop_empty()
            self._refresh_gauges()
        return out

    # ------------------------------------------------------------ admit

    def _on_arrived(self, event: ev.RequestArrived, out: Outbox, now: float) -> None:
        """The request's own first answer: Queued, Placed (re-attach) or
        Rejected; a request it displaced, then a placement by the dispatch
        that follows, come after it."""
        displaced: list[Delivery] = []
        try:
            notice: Notice = self._admit(event.options, now, displaced)
        except AdmissionError as err:
            notice = self._requests.rejected(err.reason, err.message, err.retry_after)
        out.notices.append((event.options.request_id, notice))
        out.notices.extend(displaced)

    def _admit(self, options: AdmitOptions, now: float, displaced: list[Delivery]) -> Notice:
        validate_options(options)
        if options.resume:
            return self._detached.resume(options, now)
        if options.request_id in self._requests:
            raise AdmissionError(
                RejectReason.INVALID,
                f"request_id {options.request_id!r} is already admitted on another stream; "
                "use a fresh id",
            )
        if self.shutting_down:
            raise AdmissionError(
                RejectReason.DRAINING, "the scheduler is shutting down; retry shortly",
                self._limits.retry_min,
            )
        if options.running_on_engine:
            placed = self._reattach(options, now)
            if placed is not None:
                return placed
        if options.together_with and not options.batch:  # together skips the slot filters
            placed = self._together(options, now)
            if placed is not None:
                return placed
        arrival = self._arrival(options, now)
        self.fleet.check_servable(options, frozenset(), now)
        expires_at, ttl_reason = self.deadlines.queue_expiry(
            options, self._limits.expires_at(options, arrival, now - self._clock.wall()), arrival, now)
        if now >= expires_at:
            raise AdmissionError(RejectReason.EXPIRED, f"the request waited {now - arrival:.1f} s, past the "
                                 f"P{options.priority} queue-wait deadline, {ttl_reason}",
                                 self._retry_after_for(options.priority))
        cls_now = self._aging.class_at(options.priority, arrival, now)
        rate = self._rate.rate(now)
        displaced.extend(self._room.admit_room(options, cls_now, rate, now))
        entry = QueueEntry(
            options=options, seq=next(self._seq), arrival=arrival,
            base_class=options.priority, cls=options.priority, expires_at=expires_at, ttl_reason=ttl_reason,
        )
        queue = self.waiting.queue(options.model)
        self.metrics.count_promotions(queue.push(entry, now))
        self._requests.add(RequestRecord(options, RequestState.QUEUED, entry=entry, arrival=arrival))
        self.metrics.admissions.labels(priority_label(options.priority)).inc()
        return self._queued_info(queue.position_of(entry), entry.cls, rate)

    def _arrival(self, options: AdmitOptions, now: float) -> float:
        """Monotonic arrival; a re-admitted request keeps its original time."""
        if options.arrival_unix <= 0:
            return now
        waited = max(0.0, self._clock.wall() - options.arrival_unix)
        return now - waited

    def _reattach(self, options: AdmitOptions, now: float) -> PlacedInfo | None:
        """Soft state after a scheduler restart: the request runs on a known
        engine already, so lease it there without queueing or reserving."""
        record = self.fleet.get(options.running_on_engine)
        if record is None or record.info.model != options.model:
            return None
        rec = RequestRecord(options, RequestState.PLACED, arrival=now)
        self._requests.add(rec)
        lease = self._requests.open_lease(rec, record, reserved=0, cached=0, now=now)
        self.metrics.placed(self.policy.name, "reattach", 0, 0)
        return PlacedInfo(record.engine_id, record.info.address, lease.lease_id, 0, record.info.incarnation)

    def _together(self, options: AdmitOptions, now: float) -> PlacedInfo | None:
        """A copy of a running request (a choice of n > 1): leased on that
        request's engine now, reserving blocks for its own decode, so the copies
        share the prompt's KV there. None (queue as usual) if that request holds
        no lease, is another tenant's or its engine no longer serves."""
        twin = self._requests.get(options.together_with)
        if twin is None or twin.lease is None or twin.options.tenant != options.tenant:
            return None
        record = self.fleet.get(twin.lease.engine_id)
        if record is None or record.info.model != options.model or not self.fleet.takes_work(record):
            return None
        rec = RequestRecord(options, RequestState.PLACED, arrival=now)
        self._requests.add(rec)
        reserved = -(-options.max_tokens // max(1, record.info.block_size))
        lease = self._requests.open_lease(rec, record, reserved=reserved, cached=options.prompt_tokens, now=now)
        self.metrics.placed(self.policy.name, "together", options.prompt_tokens, options.prompt_tokens)
        return PlacedInfo(record.engine_id, record.info.address, lease.lease_id, options.prompt_tokens,
                          record.info.incarnation)

    # ------------------------------------------------------------ the request's stream

    def _on_closed(self, event: ev.StreamClosed, out: Outbox, now: float) -> None:
        rec = self._requests.get(event.request_id)
        if rec is not None and not self._detached.keep(rec, now):
            self._requests.finish(rec, Outcome.WITHDRAWN, now)

    def _on_first_token(self, event: ev.FirstToken, out: Outbox, now: float) -> None:
        rec = self._requests.get(event.request_id)
        if rec is not None and rec.lease is not None and rec.lease.first_token_at is None:
            rec.lease.first_token_at = now
            self.deadlines.first_token(rec, now)

    def _on_done(self, event: ev.RequestDone, out: Outbox, now: float) -> None:
        """The lease ends now (the stream's close later finds nothing to do)."""
        rec = self._requests.get(event.request_id)
        if rec is not None:
            self.deadlines.observe_gaps(rec.options.model, rec.options.priority, event.delta_gaps, now)
            self._requests.finish(rec, Outcome.WITHDRAWN if event.withdrawn else Outcome.DONE, now)

    # ------------------------------------------------------------ place and dispatch

    def _dispatch(self) -> list[Delivery]:
        """Place every waiting request that can be placed now: per model, the
        Replace lane first, then the class queues in order. A model stops at
        its first request that cannot be placed (strict priority: smaller
        requests behind it do not overtake it)."""
        now = self._clock.monotonic()
        deliveries = self._advance(now)
        for model in self.waiting.models():
            deliveries.extend(self._dispatch_model(model, now))
        return deliveries

    def _dispatch_model(self, model: str, now: float) -> list[Delivery]:
        out: list[Delivery] = []
        lane = self.waiting.lane(model)
        while lane:
            rec = next(iter(lane.values()))
            rec.exclude = self.fleet.exclusions(rec.exclude, rec.ran_on)  # an engine restarted since is not
            notice = self._place_or_preempt(rec, rec.options.priority, now, out)
            if notice is None:
                return out
            lane.pop(rec.options.request_id, None)
            out.append((rec.options.request_id, notice))
        queue = self.waiting.existing_queue(model)
        while queue is not None:
            entry = queue.peek()
            if entry is None:
                break
            rec = self._requests[entry.request_id]
            notice = self._place_or_preempt(rec, entry.cls, now, out, entry, queue)
            if notice is None:
                break
            out.append((entry.request_id, notice))
        return out

    def _place_or_preempt(
        self, rec: RequestRecord, cls: int, now: float, out: list[Delivery],
        entry: QueueEntry | None = None, queue: ModelQueue | None = None,
    ) -> Notice | None:
        """`_try_place`; with no room now and `cls` a preempt class, preempt
        one lower-class lease (its Preempted into `out`) and place there."""
        notice = self._try_place(rec, now, out, entry, queue)
        if notice is None and cls in self._preempt_classes:
            preempted = self._room.preempt_for(rec, cls, now)
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
        opts = rec.options
        cls = entry.cls if entry is not None else opts.priority
        request, began = placement_request(rec, cls), time.perf_counter()  # decision time: real CPU time
        placement = self._yield.place(request, now, out)
        self.metrics.decision_seconds.labels(self.policy.name).observe(time.perf_counter() - began)
        if placement is None:
            try:
                self.fleet.check_servable(opts, rec.exclude, now, replacing=entry is None)
            except AdmissionError as err:
                if entry is not None and queue is not None:
                    queue.pop(entry)
                return self._requests.reject(rec, now, err.reason, err.message, err.retry_after)
            return None
        waited = 0.0
        if entry is not None and queue is not None:
            queue.pop(entry)
            waited = max(0.0, now - entry.arrival)
            if not entry.resumed:   # a requeued request's wait is kvmesh_scheduler_preempted_seconds
                self.metrics.queue_wait.labels(priority_label(entry.base_class)).observe(waited)
                self.deadlines.queued(opts, entry.base_class, waited, now)
        engine = self.fleet.get(placement.view.engine_id)
        if engine is None:  # pragma: no cover - views come from the registry
            raise RuntimeError("placement chose an unknown engine")
        kind = "replace" if entry is None else ("warm" if placement.cached_tokens else "cold")
        rec.entry = None
        lease = self._requests.open_lease(
            rec, engine, placement.blocks_needed, placement.cached_tokens, now, cls)
        self._rate.record(now)
        self.metrics.placed(self.policy.name, kind, opts.prompt_tokens, placement.cached_tokens)
        detail = PlacementDetail(self.policy.name, kind, waited, placement.scored, entry) if self.explain else None
        return PlacedInfo(engine.engine_id, engine.info.address, lease.lease_id, placement.cached_tokens,
                          engine.info.incarnation, detail)

    # ------------------------------------------------------------ time and shutdown

    def _on_tick(self, event: ev.Tick, out: Outbox, now: float) -> None:
        """Aging and TTL run in every dispatch; `handle` then drops empty
        queues and refreshes the gauges. Detached leases expire here."""
        self._detached.expire(now)

    def _on_shutdown(self, event: ev.ShutdownStarted, out: Outbox, now: float) -> None:
        self.shutting_down = True
        for rec in self._requests:
            if rec.state in (RequestState.QUEUED, RequestState.REPLACING, RequestState.PREEMPTED):
                out.notices.append((rec.options.request_id, self._requests.reject(
                    rec, now, RejectReason.DRAINING, "the scheduler is shutting down; retry shortly",
                    self._limits.retry_min)))

    def _advance(self, now: float) -> list[Delivery]:
        """Aging promotions, then reject whatever waited past its time."""
        out: list[Delivery] = []
        expired = self.waiting.advance(now)
        self.metrics.count_promotions(expired.promotions)
        for entry in expired.entries:
            rec = self._requests.get(entry.request_id)
            if rec is not None:
                message = self.deadlines.expired(entry, now)
                out.append((entry.request_id, self._requests.reject(
                    rec, now, RejectReason.EXPIRED, message, self._retry_after_for(entry.cls))))
        for rec in expired.replacements:
            out.append((rec.options.request_id, self._requests.reject(
                rec, now, RejectReason.EXPIRED, "no engine had room for the replacement in time",
                self._limits.retry_min)))
        return out

    def _use_policy(self, name: str) -> None:
        """Place with policy `name` from now on (admin_knobs.py); raises
        ConfigError for a name no profile has (nothing changes then)."""
        self.policy = self._room.policy = self._engine_events.policy = build_policy(
            name, self._config, self._plugins)

    def policy_names(self) -> list[str]:
        """Every policy name `_use_policy` accepts."""
        return sorted({*builtin_profiles(), *self._config.policy_profiles})

    def _retry_after_for(self, cls: int) -> float:
        now = self._clock.monotonic()
        ahead = sum(self.waiting.class_len(c) for c in range(cls + 1))
        return self._limits.retry_after(ahead, self._rate.rate(now))

    def _refresh_gauges(self) -> None:
        now = self._clock.monotonic()
        self.metrics.leases.set(self.fleet.lease_count())
        fresh = self.fleet.fresh_count(now)
        self.metrics.engines.labels("fresh").set(fresh)
        self.metrics.engines.labels("stale").set(len(self.fleet) - fresh)
        self._gauges.refresh(self.fleet, self.waiting, now)
        self.deadlines.refresh_metrics(now)

    # ------------------------------------------------------------ queries (read only)

    def queued_total(self) -> int:
        return self.waiting.queued_total()

    def _queued_info(self, position: int, cls: int, rate: float) -> QueuedInfo:
        return QueuedInfo(position, (position + 1) / rate if rate > 0 else 0.0, cls)

    def queued_updates(self) -> list[tuple[str, QueuedInfo]]:
        """Current position of every queued request (one O(n log n) pass)."""
        rate = self._rate.rate(self._clock.monotonic())
        return [
            (entry.request_id, self._queued_info(position, entry.cls, rate))
            for entry, position in self.waiting.positions()
        ]

    def request_state(self, request_id: str) -> RequestState | None:
        rec = self._requests.get(request_id)
        return None if rec is None else rec.state

    def lease_of(self, request_id: str) -> Lease | None:
        rec = self._requests.get(request_id)
        return None if rec is None else rec.lease

    def lease_holder(self, request_id: str) -> str | None:
        rec = self._requests.get(request_id)
        return None if rec is None else rec.holder()

    def state(self) -> StateView:
        now = self._clock.monotonic()
        return StateView(
            self.policy.name, self.waiting.stats(now), self.fleet.stats(now),
            self.queued_total(), self.fleet.lease_count(), self._ledger.snapshot(),
            sorted(self.waiting.paused), sorted(self.fleet.admin_drained), self.deadlines.states(now))
