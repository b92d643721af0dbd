"""The scheduler core: the one owner of the scheduler's mutable state.

Ownership rule: the core owns all mutable scheduler state, through three objects only it calls:
`RequestBook` (request_book.py: every admitted request's record and lease), `WaitingRoom` (waiting.py: the
model queues and Replace lanes) and `EngineFleet` (fleet.py: the engine registry, KV index, reservations,
leases and engine views), plus the per-class counters of `ClassLedger` (class_stats.py). Helpers it owns act
on them only when it calls: the phases `Admission` (admit.py) and `Dispatcher` (dispatch.py), which get
these objects together (`CoreParts`, core_parts.py), `RoomMaker` (making_room.py: displacement at
admission, preemption in dispatch), `Comebacks` (comebacks.py: Replace and Requeue) and `DetachedLeases`
(detached_leases.py: leases kept for a stream resume); `EngineEvents` (engine_events.py) handles the
engines' Connect-stream events, `AdminKnobs` (admin_knobs.py) the operator's (pause, drain, policy),
`DeadlineBook` (deadlines.py) learns deadlines. All of it changes only inside `SchedulerCore.handle`, called
only from the event loop's thread (grpc_api.py and engine_links.py for stream messages, server.py's timers
for `Tick`); synchronous, so no two events interleave and no lock is needed.

One entry point: `handle(event) -> Outbox` applies one event (events.py),
then ALWAYS dispatches (idempotent, cheap when nothing waits: no caller can
strand a placement by forgetting to), and returns everything to deliver. Each request is finalised exactly once, by
`RequestBook.finish` (request_book.py), which every exit path goes through.

Phases of a request and where each lives:
  admit     `Admission` (admit.py): checks (admission_limits.py), the aging
            class (aging.py), queue room by its class's rules (classes.py;
            at a tenant's cap the displacement of its lowest class,
            making_room.py), then into its model's queue (waiting.py,
            queue.py; fairness and ordering from queue_policies.py);
  place     `Dispatcher` (dispatch.py) asks the placement policy
            (placement/) over the fleet's engine views (fleet.py), through
            batch_yield.py: for a class that preempts, yielding classes'
            slots count as room (one yields);
  preempt   when a queue head of a class that preempts cannot be placed,
            `RoomMaker.preempt_for` ends one lower-class, unprotected lease
            (victim rule: preemption.py) and the head is placed on that
            engine in the same dispatch; the victim is told Preempted and
            waits PREEMPTED;
  dispatch  `Dispatcher.dispatch` (dispatch.py): aging and TTL, then per
            model the Replace lane, then the queue, in order, until one
            cannot be placed; leases via the request book;
  requeue   a preempted request's Requeue puts it back in its class queue
            with its original arrival, no TTL (comebacks.py);
  finish    `RequestBook.finish` (request_book.py): out of queue and lane,
            lease ended, counted; idempotent, from any state (PREEMPTED
            included).
What each class may do (aging, caps, TTL, preemption, reserved slots) is one
table, classes.py, built from the config here and read by every phase.

Lifecycle (records.RequestState): QUEUED -> PLACED -> FINISHED, with
PLACED -> PREEMPTED -> (Requeue) QUEUED, PLACED -> ORPHANED / REPLACING /
DETACHED -> PLACED, and FINISHED reachable from every state.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from typing import Any

from services.common.clock import Clock
from services.common.config import MeshConfig

from . import events as ev
from .admin_knobs import AdminKnobs
from .admission_limits import AdmissionLimits, DispatchRateMeter
from .admit import Admission, queued_info
from .aging import AgingRule
from .batch_yield import BatchYield
from .class_stats import ClassLedger, ClassStat
from .classes import ClassTable
from .comebacks import Comebacks
from .core_parts import CoreParts
from .deadlines import DeadlineBook
from .detached_leases import DetachedLeases
from .dispatch import Dispatcher
from .engine_events import EngineEvents
from .events import Delivery, Outbox
from .fleet import EngineFleet, EngineStat
from .fleet_gauges import FleetGauges
from .making_room import RoomMaker
from .metrics import SchedulerMetrics
from .peer_heads import PeerHeads
from .placement import PlacementPolicy, build_policy, builtin_profiles, builtin_registry
from .records import (
    AdmissionError,
    AdmitOptions,
    Lease,
    Notice,
    Outcome,
    QueuedInfo,
    RejectReason,
    RequestRecord,
    RequestState,
)
from .request_book import RequestBook
from .scaling import Scaler
from .spares import SpareKeeper
from .state_view import StateView
from .waiting import QueueStat, WaitingRoom

__all__ = ["ClassStat", "EngineStat", "QueueStat", "SchedulerCore", "StateView"]

log = logging.getLogger(__name__)

# Events after which the spare keeper looks at the queues (spares.py `review`):
# those that add waiting work, and the tick (waits grow with time alone).
_ADDS_WORK = frozenset({ev.RequestArrived, ev.ReplaceRequested, ev.RequeueRequested, ev.Tick})


class SchedulerCore:
    def __init__(
        self, config: MeshConfig, clock: Clock, metrics: SchedulerMetrics | None = None
    ) -> None:
        self._config = config.scheduler
        self._clock = clock
        self.metrics = metrics or SchedulerMetrics()
        self.classes = ClassTable.from_config(self._config)  # what each class may do
        self._aging = AgingRule.from_config(self._config.aging)
        self._limits = AdmissionLimits.from_config(self._config, self.classes)
        plugins = self._plugins = builtin_registry(self._config)
        self.policy: PlacementPolicy = build_policy(self._config.policy, self._config, plugins, clock.monotonic)
        self.metrics.policy_in_force(self.policy.name)
        self.waiting = WaitingRoom(self._aging, plugins.make_fairness(self._config.queue_fairness),
                                   plugins.make_ordering(self._config.queue_ordering), self.classes)
        autoscaled = frozenset(m.name for m in config.models) if self._config.scaling.enabled else frozenset()
        self.fleet = EngineFleet(self._config, clock.monotonic(), self._limits.retry_min, self.classes, autoscaled)
        self._ledger = ClassLedger(self.metrics)
        self.scaling = Scaler(config, self.metrics, clock.monotonic())  # scaling/: the engines each model needs
        self.deadlines = DeadlineBook(config, self.metrics, self.classes)  # deadlines.py: from live p95s
        self._gauges = FleetGauges(self.metrics, self._aging, [m.name for m in config.models],
                                   self._config.stale_report_seconds, classes=self.classes)
        self._requests = RequestBook(self.fleet, self.waiting, self.metrics, self._ledger, self.classes)
        self._detached = DetachedLeases(self._requests, self.fleet, config.resume.grace_seconds)
        self._room = RoomMaker(
            self._requests, self.waiting, self.fleet, self.policy, self._limits, self._ledger, config)
        # The other replicas' queue heads: priority across replicas (peer_heads.py).
        self.peers = PeerHeads(self._config.peers, lambda outcome: self.metrics.peer_holds.labels(outcome).inc())
        parts = self._parts = CoreParts(
            self._config, clock, self.metrics, self.classes, self._aging, self._limits,
            DispatchRateMeter(self._config.dispatch_rate_window_seconds), self.waiting, self.fleet,
            self._requests, self._room, self.deadlines, itertools.count(), self.peers)
        self._admission = Admission(parts, self._detached)
        self._dispatcher = Dispatcher(parts, BatchYield(self._requests, self.fleet, self._room, config))
        self._comebacks = Comebacks(
            self._requests, self.waiting, self.fleet, self._limits, self._ledger, parts.seq,
            self.metrics.count_promotions)
        # Warm spares (spares.py): which engines placement skips, promotion and return.
        self.spares = SpareKeeper(self._config.spares, self.fleet, self.waiting, self.metrics,
                                  self._config.prefill_tokens_per_second, [m.name for m in config.models])
        self._engine_events = EngineEvents(self.fleet, self._requests, self.policy, self.metrics,
                                           self._gauges.touch, self._config.stale_report_seconds,
                                           self.waiting.replacing)
        self._handlers: dict[type, Callable[[Any, Outbox, float], None]] = {
            ev.RequestArrived: self._on_arrived, ev.StreamClosed: self._on_closed,
            ev.FirstToken: self._on_first_token, ev.RequestDone: self._on_done,
            ev.ReplaceRequested: self._comebacks.replace,
            ev.RequeueRequested: self._comebacks.requeue,
            ev.Tick: self._on_tick, ev.ShutdownStarted: self._on_shutdown,
            ev.PeerHeadsHeard: self._on_peer_heads,
            **self._engine_events.handlers(),
            **AdminKnobs(self.waiting, self.fleet, self.metrics, self._use_policy).handlers(),
        }

    @property
    def explain(self) -> bool:
        """Placements carry a PlacementDetail (the request's trace); off = none built."""
        return self._dispatcher.explain

    @explain.setter
    def explain(self, on: bool) -> None:
        self._dispatcher.explain = on

    @property
    def shutting_down(self) -> bool:
        return self._admission.shutting_down

    # ------------------------------------------------------------ the entry point

    def handle(self, event: ev.Event) -> Outbox:
        """Apply one event, dispatch, and return what to deliver."""
        out = Outbox()
        now = self._clock.monotonic()
        self._handlers[type(event)](event, out, now)
        if out.dispatch:
            out.notices.extend(self._dispatcher.dispatch())
        # A spare promoted for what is still queued is placed on in the same event (spares.py).
        if self.spares.review(now, type(event) in _ADDS_WORK) | (isinstance(event, ev.Tick) and self.spares.tick(now)):
            out.notices.extend(self._dispatcher.dispatch())
        self.spares.placed(out.notices, now)
        self.deadlines.stamp_all(out.notices, self._requests.get, self._clock.monotonic())
        if isinstance(event, ev.Tick):
            self.waiting.drop_empty()
            self._refresh_gauges()
        return out

    # ------------------------------------------------------------ admit (admit.py)

    def _on_arrived(self, event: ev.RequestArrived, out: Outbox, now: float) -> None:
        """The request's own first answer: Queued, Placed (re-attach) or
        Rejected; a request it displaced, then a placement by the dispatch
        that follows, come after it."""
        displaced: list[Delivery] = []
        try:
            notice: Notice = self._admission.admit(event.options, now, displaced)
            self._count_demand(event.options)
        except AdmissionError as err:
            notice = self._requests.rejected(err.reason, err.message, err.retry_after)
        out.notices.append((event.options.request_id, notice))
        out.notices.extend(displaced)

    def _count_demand(self, options: AdmitOptions) -> None:
        """A new request for the scaling policy (not a resume or a re-attach:
        those were counted when they first came)."""
        if not options.resume and not options.running_on_engine:
            self.scaling.arrived(options.model, options.priority, options.prompt_tokens, options.max_tokens,
                                 self.fleet.serves(options.model))

    # ------------------------------------------------------------ the request's stream

    def _on_closed(self, event: ev.StreamClosed, out: Outbox, now: float) -> None:
        rec = self._requests.get(event.request_id)
        if rec is not None and not self._detached.keep(rec, now):
            self._requests.finish(rec, Outcome.WITHDRAWN, now)

    def _on_first_token(self, event: ev.FirstToken, out: Outbox, now: float) -> None:
        self._first_token(self._requests.get(event.request_id), now - max(0.0, event.seconds_ago))

    def _first_token(self, rec: RequestRecord | None, at: float) -> None:
        if rec is not None and rec.lease is not None and rec.lease.first_token_at is None:
            rec.lease.first_token_at = at
            self.spares.first_token(rec.lease.engine_id, at)
            self.deadlines.first_token(rec, at)

    def _on_done(self, event: ev.RequestDone, out: Outbox, now: float) -> None:
        """The lease ends now (the stream's close later finds nothing to do);
        a first token folded into it is taken first, dated back."""
        rec = self._requests.get(event.request_id)
        if rec is not None:
            if event.first_token_ago is not None:
                self._first_token(rec, now - max(0.0, event.first_token_ago))
            self.deadlines.observe_gaps(rec.options.model, rec.options.priority, event.delta_gaps, now)
            self.scaling.finished(rec.options.model, event.prompt_tokens, event.completion_tokens,
                                  event.cached_tokens)
            self._requests.finish(rec, Outcome.WITHDRAWN if event.withdrawn else Outcome.DONE, now)

    # ------------------------------------------------------------ time and shutdown

    def _on_tick(self, event: ev.Tick, out: Outbox, now: float) -> None:
        """Aging and TTL run in every dispatch; `handle` then drops empty
        queues and refreshes the gauges. Detached leases expire here."""
        self._detached.expire(now)
        self.scaling.tick(self.fleet, self.fleet.admin_drained, self.waiting, now, self.fleet.spares)

    def _on_peer_heads(self, event: ev.PeerHeadsHeard, out: Outbox, now: float) -> None:
        """Another replica's heads; the dispatch that follows places what it
        no longer waits for (a head placed there frees the room left to it)."""
        if event.heads is None:
            self.peers.gone(event.replica)
        else:
            self.peers.heard(event.replica, event.heads, now)

    def _on_shutdown(self, event: ev.ShutdownStarted, out: Outbox, now: float) -> None:
        self._admission.shutting_down = True
        for rec in self._requests:
            if rec.state in (RequestState.QUEUED, RequestState.REPLACING, RequestState.PREEMPTED):
                out.notices.append((rec.options.request_id, self._requests.reject(
                    rec, now, RejectReason.DRAINING, "the scheduler is shutting down; retry shortly",
                    self._limits.retry_min)))

    def _use_policy(self, name: str) -> None:
        """Place with policy `name` from now on (admin_knobs.py); raises
        ConfigError for a name no profile has (nothing changes then)."""
        self.policy = self._room.policy = self._engine_events.policy = build_policy(
            name, self._config, self._plugins, self._clock.monotonic)
        self.metrics.policy_in_force(self.policy.name)

    def policy_names(self) -> list[str]:
        """Every policy name `_use_policy` accepts."""
        return sorted({*builtin_profiles(), *self._config.policy_profiles})

    def _refresh_gauges(self) -> None:
        now = self._clock.monotonic()
        self.metrics.leases.set(self.fleet.lease_count())
        fresh = self.fleet.fresh_count(now)
        self.metrics.engines.labels("fresh").set(fresh)
        self.metrics.engines.labels("stale").set(len(self.fleet) - fresh)
        self.metrics.engines.labels("spare").set(len(self.fleet.spares))   # of those fresh or stale
        self.metrics.peers_fresh.set(len(self.peers.fresh(now)))
        self._gauges.refresh(self.fleet, self.waiting, now)
        self.deadlines.refresh_metrics(now)

    # ------------------------------------------------------------ queries (read only)

    def queued_total(self) -> int:
        return self.waiting.queued_total()

    def queued_updates(self) -> list[tuple[str, QueuedInfo]]:
        """Current position of every queued request (one O(n log n) pass)."""
        rate = self._parts.rate.rate(self._clock.monotonic())
        return [
            (entry.request_id, queued_info(position, entry.cls, rate))
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
            sorted(self.waiting.paused), sorted(self.fleet.admin_drained), self.deadlines.states(now),
            list(self.scaling.decisions.values()), self.peers.fresh(now))
