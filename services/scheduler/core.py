"""The scheduler core: the one owner of the scheduler's mutable state.

Ownership rule: queues, requests, leases, reservations, the engine registry
and the KV index are touched only through `SchedulerCore`'s methods, and
those are called only from the event loop's thread (service.py). Every
method is synchronous and runs to completion without awaiting, so no two
calls ever interleave and no lock is needed. Methods that can let queued
requests leave return the notices for their Admit streams; the caller
delivers them. Every request is finalised exactly once: `_finish` is
idempotent and every exit path (done, withdraw, reject, expiry) goes through it.

Phases, each its own method: admit -> (aging/expiry: `_advance`) ->
dispatch (`_dispatch_model`: place, reserve, lease) -> finish.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from services.common.clock import Clock
from services.common.config import MeshConfig

from .admission import AdmissionLimits, DispatchRateMeter, validate_options
from .aging import AgingRule
from .kv_index import KvIndex
from .metrics import SchedulerMetrics
from .placement import EngineView, PlacementPolicy, PlacementRequest, build_policy, builtin_registry
from .queue import ModelQueue, Promotion
from .queue_policies import FifoOrdering, RoundRobinTenants
from .records import (
    NUM_CLASSES,
    AdmissionError,
    AdmitOptions,
    Lease,
    Notice,
    Outcome,
    PlacedInfo,
    QueuedInfo,
    QueueEntry,
    RejectedInfo,
    RejectReason,
    RequestRecord,
    RequestState,
)
from .registry import EngineInfo, EngineLoad, EngineRecord, EngineRegistry
from .reservations import ReservationBook, blocks_needed

__all__ = ["EngineStat", "QueueStat", "SchedulerCore", "StateView"]

# (request id, what to tell its Admit stream)
Delivery = tuple[str, Notice]


@dataclass(frozen=True)
class QueueStat:
    priority: int
    tenant: str
    queued: int
    oldest_wait_seconds: float


@dataclass(frozen=True)
class EngineStat:
    view: EngineView
    address: str
    cached_blocks: int
    backend: str


@dataclass(frozen=True)
class StateView:
    policy: str
    queues: list[QueueStat]
    engines: list[EngineStat]
    queued_total: int
    leases_total: int


class SchedulerCore:
    def __init__(
        self, config: MeshConfig, clock: Clock, metrics: SchedulerMetrics | None = None
    ) -> None:
        self._config = config.scheduler
        self._hash_block_tokens = config.hash_block_tokens
        self._clock = clock
        self.metrics = metrics or SchedulerMetrics()
        self._aging = AgingRule.from_config(self._config.aging)
        self._limits = AdmissionLimits.from_config(self._config)
        self._rate = DispatchRateMeter(self._config.dispatch_rate_window_seconds)
        self.policy: PlacementPolicy = build_policy(
            self._config.policy, self._config, builtin_registry(self._config)
        )
        self._fairness = RoundRobinTenants()
        self._ordering = FifoOrdering()
        self._queues: dict[str, ModelQueue] = {}
        self._lanes: dict[str, OrderedDict[str, RequestRecord]] = {}  # Replace, ahead of queues
        self._requests: dict[str, RequestRecord] = {}
        self._leases: dict[str, Lease] = {}
        self.engines = EngineRegistry(self._config.initial_service_seconds)
        self.kv = KvIndex()
        self.reservations = ReservationBook()
        self._seq = itertools.count()
        self._lease_ids = itertools.count(1)
        self._started = clock.monotonic()
        self._model_seen: dict[str, float] = {}
        self.shutting_down = False

    # ------------------------------------------------------------ requests

    def admit(self, options: AdmitOptions) -> Notice:
        """Queue a request (or re-attach a running one). Returns the first
        answer for its stream: Queued, Placed (re-attach) or Rejected."""
        now = self._clock.monotonic()
        try:
            return self._admit(options, now)
        except AdmissionError as err:
            return self._rejected(err.reason, err.message, err.retry_after)

    def _admit(self, options: AdmitOptions, now: float) -> Notice:
        validate_options(options)
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
        arrival = self._arrival(options, now)
        self._check_servable(options, frozenset(), now)
        expires_at = self._limits.expires_at(options.priority, arrival)
        if now >= expires_at:
            raise AdmissionError(
                RejectReason.EXPIRED,
                f"the request waited {now - arrival:.1f} s, past the P{options.priority} "
                "time-to-live",
                self._retry_after_for(options.priority),
            )
        cls_now = self._aging.class_at(options.priority, arrival, now)
        rate = self._rate.rate(now)
        self._limits.check_caps(
            cls_now, self.class_len(cls_now), options.tenant, self.tenant_len(options.tenant), rate
        )
        entry = QueueEntry(
            options=options, seq=next(self._seq), arrival=arrival,
            base_class=options.priority, cls=options.priority, expires_at=expires_at,
        )
        queue = self._queue(options.model)
        self._count_promotions(queue.push(entry, now))
        self._requests[options.request_id] = RequestRecord(options, RequestState.QUEUED, entry=entry)
        self.metrics.admissions.labels(str(options.priority)).inc()
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
        record = self.engines.get(options.running_on_engine)
        if record is None or record.info.model != options.model:
            return None
        rec = RequestRecord(options, RequestState.PLACED)
        self._requests[options.request_id] = rec
        lease = self._new_lease(rec, record, reserved=0, cached=0, now=now)
        self.metrics.placed(self.policy.name, "reattach", 0, 0)
        return PlacedInfo(record.engine_id, record.info.address, lease.lease_id, 0)

    def withdraw(self, request_id: str) -> list[Delivery]:
        """The Admit stream ended: leave the queue / end the lease at once.
        Idempotent. Returns notices for requests the freed room placed."""
        rec = self._requests.get(request_id)
        if rec is None:
            return []
        self._finish(rec, Outcome.WITHDRAWN)
        return self.dispatch()

    def first_token(self, request_id: str) -> None:
        rec = self._requests.get(request_id)
        if rec is not None and rec.lease is not None and rec.lease.first_token_at is None:
            rec.lease.first_token_at = self._clock.monotonic()

    def done(self, request_id: str) -> list[Delivery]:
        """The gateway reports completion: the lease ends now (the stream's
        close later finds nothing left to do)."""
        rec = self._requests.get(request_id)
        if rec is None:
            return []
        self._finish(rec, Outcome.DONE)
        return self.dispatch()

    def replace(
        self,
        request_id: str,
        exclude: Sequence[str],
        prompt_tokens: int,
        max_tokens: int,
        prefix_hashes: Sequence[int],
    ) -> list[Delivery]:
        """The request's engine failed: end its lease and place it again,
        avoiding `exclude`, ahead of the queue. The answer (Placed or
        Rejected) is among the returned deliveries, or comes with a later
        dispatch when every eligible engine is full right now."""
        rec = self._requests.get(request_id)
        if rec is None:
            return []
        if rec.state not in (RequestState.PLACED, RequestState.ORPHANED):
            reason = "replace is only valid after placed" if rec.state is RequestState.QUEUED else (
                "a replace is already pending"
            )
            return [(request_id, self._reject_record(rec, RejectReason.INVALID, reason))]
        self._end_lease(rec)
        rec.options = dataclasses.replace(
            rec.options, prompt_tokens=prompt_tokens, max_tokens=max_tokens,
            prefix_hashes=tuple(prefix_hashes),
        )
        rec.exclude = frozenset(exclude)
        now = self._clock.monotonic()
        try:
            if prompt_tokens <= 0:
                raise AdmissionError(RejectReason.INVALID, "replace: prompt_tokens must be > 0")
            self._check_servable(rec.options, rec.exclude, now, replacing=True)
        except AdmissionError as err:
            return [(request_id, self._reject_record(rec, err.reason, err.message, err.retry_after))]
        rec.state = RequestState.REPLACING
        rec.replace_expires_at = now + self._limits.ttl_seconds[rec.options.priority]
        self._lanes.setdefault(rec.options.model, OrderedDict())[request_id] = rec
        return self.dispatch()

    # ------------------------------------------------------------ dispatch

    def dispatch(self) -> list[Delivery]:
        """Place every waiting request that can be placed now: per model, the
        Replace lane first, then the class queues in order. A model stops at
        its first request that cannot be placed (strict priority: smaller
        requests behind it do not overtake it). Runs on every event that can
        create room."""
        now = self._clock.monotonic()
        deliveries = self._advance(now)
        for model in list(self._lanes.keys() | self._queues.keys()):
            deliveries.extend(self._dispatch_model(model, now))
        return deliveries

    def _dispatch_model(self, model: str, now: float) -> list[Delivery]:
        out: list[Delivery] = []
        lane = self._lanes.get(model)
        while lane:
            rec = next(iter(lane.values()))
            notice = self._try_place(rec, now)
            if notice is None:
                return out
            lane.pop(rec.options.request_id, None)
            out.append((rec.options.request_id, notice))
        queue = self._queues.get(model)
        while queue is not None:
            entry = queue.peek()
            if entry is None:
                break
            rec = self._requests[entry.request_id]
            notice = self._try_place(rec, now, entry=entry, queue=queue)
            if notice is None:
                break
            out.append((entry.request_id, notice))
        return out

    def _try_place(
        self, rec: RequestRecord, now: float,
        entry: QueueEntry | None = None, queue: ModelQueue | None = None,
    ) -> Notice | None:
        """Placed, Rejected (it can never be placed), or None (no room now)."""
        opts = rec.options
        request = PlacementRequest(
            opts.request_id, opts.model, opts.prompt_tokens, opts.max_tokens,
            opts.prefix_hashes, rec.exclude, priority=entry.cls if entry is not None else opts.priority,
        )
        placement = self.policy.place(
            request, self._engine_views(now, opts.model), self.kv,
            self._hash_block_tokens, self._config.decode_headroom_tokens,
        )
        if placement is None:
            try:
                self._check_servable(opts, rec.exclude, now, replacing=entry is None)
            except AdmissionError as err:
                if entry is not None and queue is not None:
                    queue.pop(entry)
                return self._reject_record(rec, err.reason, err.message, err.retry_after)
            return None
        if entry is not None and queue is not None:
            queue.pop(entry)
            self.metrics.queue_wait.labels(str(entry.base_class)).observe(max(0.0, now - entry.arrival))
        engine = self.engines.get(placement.view.engine_id)
        if engine is None:  # pragma: no cover - views come from the registry
            raise RuntimeError("placement chose an unknown engine")
        kind = "replace" if entry is None else ("warm" if placement.cached_tokens else "cold")
        rec.state = RequestState.PLACED
        rec.entry = None
        lease = self._new_lease(rec, engine, placement.blocks_needed, placement.cached_tokens, now)
        self._rate.record(now)
        self.metrics.placed(self.policy.name, kind, opts.prompt_tokens, placement.cached_tokens)
        return PlacedInfo(engine.engine_id, engine.info.address, lease.lease_id, placement.cached_tokens)

    def _check_servable(
        self, options: AdmitOptions, exclude: frozenset[str], now: float, replacing: bool = False
    ) -> None:
        """Raise when no engine could ever take the request (as opposed to
        none having room right now)."""
        engines = [e for e in self.engines if e.info.model == options.model]
        if engines:
            self._model_seen[options.model] = now
        else:
            seen = self._model_seen.get(options.model, self._started)
            if replacing or now - seen > self._config.engine_grace_seconds:
                raise AdmissionError(
                    RejectReason.NO_ENGINE,
                    f"no engine serves model {options.model!r}; check the model name or start "
                    "an engine for it",
                    self._limits.retry_min,
                )
            return
        usable = [e for e in engines if e.engine_id not in exclude]
        if not usable:
            raise AdmissionError(
                RejectReason.NO_ENGINE,
                f"every engine serving {options.model!r} is excluded by the replace",
                self._limits.retry_min,
            )
        need_len = options.prompt_tokens + options.max_tokens
        for e in usable:
            fits_len = e.info.max_model_len <= 0 or need_len <= e.info.max_model_len
            cold = blocks_needed(
                options.prompt_tokens, options.max_tokens, 0, e.info.block_size,
                self._config.decode_headroom_tokens,
            )
            if fits_len and cold <= e.blocks_total():
                return
        raise AdmissionError(
            RejectReason.TOO_LARGE,
            f"{options.prompt_tokens} prompt + {options.max_tokens} max tokens fit on no engine "
            f"serving {options.model!r}; shorten the prompt or lower max_tokens",
        )

    def _engine_views(self, now: float, model: str) -> list[EngineView]:
        return [self._view(e, now) for e in self.engines if e.info.model == model]

    def _view(self, e: EngineRecord, now: float) -> EngineView:
        weight = e.info.weight if e.info.weight > 0 else 1.0
        occupancy = max(len(e.leases), e.load.running + e.load.waiting)
        excess = max(0, occupancy + 1 - e.info.max_running)
        queue_seconds = (
            e.load.queued_tokens / (self._config.prefill_tokens_per_second * weight)
            + excess * e.service_seconds / max(1, e.info.max_running)
        )
        return EngineView(
            engine_id=e.engine_id, model=e.info.model, serving=e.load.serving,
            draining=e.draining, fresh=e.fresh(now, self._config.stale_report_seconds),
            block_size=e.info.block_size, blocks_total=e.blocks_total(),
            blocks_used=e.load.blocks_used, blocks_reserved=self.reservations.reserved(e.engine_id),
            leases=len(e.leases), lease_limit=e.info.max_running + self._config.engine_queue_slack,
            max_running=e.info.max_running, running=e.load.running, waiting=e.load.waiting,
            queued_tokens=e.load.queued_tokens, weight=weight,
            max_model_len=e.info.max_model_len, queue_seconds=queue_seconds,
            cached_blocks=e.load.cached_blocks, p0_reserved_leases=self._config.p0_reserved_leases,
        )

    # ------------------------------------------------------------ leases and finish

    def _new_lease(
        self, rec: RequestRecord, engine: EngineRecord, reserved: int, cached: int, now: float
    ) -> Lease:
        lease = Lease(
            lease_id=f"lease-{next(self._lease_ids)}", request_id=rec.options.request_id,
            engine_id=engine.engine_id, placed_at=now, reserved_blocks=reserved,
            cached_tokens=cached, prompt_tokens=rec.options.prompt_tokens,
        )
        if reserved and rec.options.request_id not in engine.load.request_ids:
            self.reservations.reserve(engine.engine_id, rec.options.request_id, reserved)
        engine.leases.add(lease.lease_id)
        self._leases[lease.lease_id] = lease
        rec.lease = lease
        rec.state = RequestState.PLACED
        self.metrics.leases.set(len(self._leases))
        return lease

    def _end_lease(self, rec: RequestRecord) -> None:
        lease, rec.lease = rec.lease, None
        if lease is None or self._leases.pop(lease.lease_id, None) is None:
            return
        self.reservations.release(lease.engine_id, lease.request_id)
        engine = self.engines.get(lease.engine_id)
        if engine is not None:
            engine.leases.discard(lease.lease_id)
            engine.observe_service(self._clock.monotonic() - lease.placed_at)
        self.metrics.leases.set(len(self._leases))

    def _finish(self, rec: RequestRecord, outcome: Outcome) -> None:
        """Finalise a request exactly once, from whatever state it is in."""
        if rec.state is RequestState.FINISHED:
            return
        request_id = rec.options.request_id
        if rec.state is RequestState.QUEUED:
            queue = self._queues.get(rec.options.model)
            if queue is not None:
                queue.remove(request_id)
        lane = self._lanes.get(rec.options.model)
        if lane is not None:
            lane.pop(request_id, None)
        self._end_lease(rec)
        rec.state = RequestState.FINISHED
        rec.entry = None
        self._requests.pop(request_id, None)
        self.metrics.finished.labels(outcome.value).inc()

    def _rejected(self, reason: RejectReason, message: str, retry_after: float = 0.0) -> RejectedInfo:
        self.metrics.rejections.labels(reason.value).inc()
        return RejectedInfo(reason, message, retry_after)

    def _reject_record(
        self, rec: RequestRecord, reason: RejectReason, message: str, retry_after: float = 0.0
    ) -> RejectedInfo:
        self._finish(rec, Outcome.REJECTED)
        return self._rejected(reason, message, retry_after)

    # ------------------------------------------------------------ time

    def tick(self) -> list[Delivery]:
        """Housekeeping from the clock: aging, TTL, gauges; then dispatch
        (a promotion can change which request is next)."""
        deliveries = self.dispatch()
        self._drop_empty_queues()
        self._refresh_gauges()
        return deliveries

    def _advance(self, now: float) -> list[Delivery]:
        out: list[Delivery] = []
        for queue in self._queues.values():
            promotions, expired = queue.advance(now)
            self._count_promotions(promotions)
            for entry in expired:
                rec = self._requests.get(entry.request_id)
                if rec is not None:
                    message = (
                        f"waited {now - entry.arrival:.1f} s in the queue, past the "
                        f"P{entry.base_class} time-to-live; retry later"
                    )
                    out.append((entry.request_id, self._reject_record(
                        rec, RejectReason.EXPIRED, message, self._retry_after_for(entry.cls))))
        for lane in self._lanes.values():
            for rec in [r for r in lane.values() if r.replace_expires_at <= now]:
                out.append((rec.options.request_id, self._reject_record(
                    rec, RejectReason.EXPIRED, "no engine had room for the replacement in time",
                    self._limits.retry_min)))
        return out

    def _count_promotions(self, promotions: list[Promotion]) -> None:
        for p in promotions:
            self.metrics.promotions.labels(str(p.from_class), str(p.to_class)).inc()

    def _retry_after_for(self, cls: int) -> float:
        now = self._clock.monotonic()
        ahead = sum(self.class_len(c) for c in range(cls + 1))
        return self._limits.retry_after(ahead, self._rate.rate(now))

    def _drop_empty_queues(self) -> None:
        for model in [m for m, q in self._queues.items() if len(q) == 0]:
            del self._queues[model]
        for model in [m for m, lane in self._lanes.items() if not lane]:
            del self._lanes[model]

    def _refresh_gauges(self) -> None:
        now = self._clock.monotonic()
        for cls in range(NUM_CLASSES):
            self.metrics.queue_length.labels(str(cls)).set(self.class_len(cls))
        self.metrics.leases.set(len(self._leases))
        fresh = sum(1 for e in self.engines if e.fresh(now, self._config.stale_report_seconds))
        self.metrics.engines.labels("fresh").set(fresh)
        self.metrics.engines.labels("stale").set(len(self.engines) - fresh)

    # ------------------------------------------------------------ queue views

    def _queue(self, model: str) -> ModelQueue:
        queue = self._queues.get(model)
        if queue is None:
            queue = self._queues[model] = ModelQueue(self._aging, self._fairness, self._ordering)
        return queue

    def class_len(self, cls: int) -> int:
        return sum(q.class_len(cls) for q in self._queues.values())

    def tenant_len(self, tenant: str) -> int:
        return sum(q.tenant_len(tenant) for q in self._queues.values())

    def queued_total(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def _queued_info(self, position: int, cls: int, rate: float) -> QueuedInfo:
        wait = (position + 1) / rate if rate > 0 else 0.0
        return QueuedInfo(position, wait, cls)

    def queued_updates(self) -> list[tuple[str, QueuedInfo]]:
        """Current position of every queued request (one O(n log n) pass)."""
        rate = self._rate.rate(self._clock.monotonic())
        return [
            (entry.request_id, self._queued_info(position, entry.cls, rate))
            for queue in self._queues.values()
            for entry, position in queue.positions()
        ]

    def request_state(self, request_id: str) -> RequestState | None:
        rec = self._requests.get(request_id)
        return None if rec is None else rec.state

    def lease_of(self, request_id: str) -> Lease | None:
        rec = self._requests.get(request_id)
        return None if rec is None else rec.lease

    # ------------------------------------------------------------ engines

    def engine_hello(self, info: EngineInfo) -> int:
        """Register an engine; returns the token its stream must present.
        Raises `DuplicateEngineError` for an id connected from elsewhere."""
        now = self._clock.monotonic()
        record, old = self.engines.register(info, now)
        if old is not None:
            self.kv.drop_engine(info.engine_id)      # the new snapshot replaces it
        self._model_seen[info.model] = now
        self._refresh_gauges()
        return record.token

    def _current(self, engine_id: str, token: int) -> EngineRecord | None:
        record = self.engines.get(engine_id)
        return record if record is not None and record.token == token else None

    def engine_load(self, engine_id: str, token: int, load: EngineLoad) -> list[Delivery]:
        record = self._current(engine_id, token)
        if record is None:
            return []
        record.load = load
        record.last_report_at = self._clock.monotonic()
        self.reservations.settle(engine_id, set(load.request_ids))
        return self.dispatch()

    def engine_kv_events(
        self, engine_id: str, token: int, seq: int,
        stored: Sequence[int], removed: Sequence[int], cleared: bool,
    ) -> bool:
        """Apply KV events; True = send Resync to the engine."""
        if self._current(engine_id, token) is None:
            return False
        resync = self.kv.apply_events(engine_id, seq, stored, removed, cleared)
        if resync:
            self.metrics.resyncs.inc()
        return resync

    def engine_kv_snapshot(self, engine_id: str, token: int, seq: int, hashes: Sequence[int]) -> None:
        if self._current(engine_id, token) is not None:
            self.kv.apply_snapshot(engine_id, seq, hashes)

    def engine_closed(self, engine_id: str, token: int) -> None:
        """The engine's stream ended: forget it, its KV entries, its
        reservations and its leases at once (their gateways see the engine
        fail and Replace or give up)."""
        record = self.engines.unregister(engine_id, token)
        if record is None:
            return
        self.kv.drop_engine(engine_id)
        self.reservations.drop_engine(engine_id)
        self.policy.forget_engine(engine_id)
        for lease_id in list(record.leases):
            lease = self._leases.pop(lease_id, None)
            if lease is None:
                continue
            rec = self._requests.get(lease.request_id)
            if rec is not None and rec.lease is lease:
                rec.lease = None
                rec.state = RequestState.ORPHANED
        record.leases.clear()
        self._refresh_gauges()

    def drain_engine(self, engine_id: str) -> bool:
        """Stop placing on an engine (its running work finishes)."""
        record = self.engines.get(engine_id)
        if record is None:
            return False
        record.draining = True
        return True

    # ------------------------------------------------------------ shutdown and state

    def shutdown(self) -> list[Delivery]:
        """Reject everything still waiting with DRAINING; refuse new work."""
        self.shutting_down = True
        out: list[Delivery] = []
        for rec in list(self._requests.values()):
            if rec.state in (RequestState.QUEUED, RequestState.REPLACING):
                out.append((rec.options.request_id, self._reject_record(
                    rec, RejectReason.DRAINING, "the scheduler is shutting down; retry shortly",
                    self._limits.retry_min)))
        return out

    def state(self) -> StateView:
        now = self._clock.monotonic()
        stats: dict[tuple[int, str], tuple[int, float]] = {}
        for queue in self._queues.values():
            for cls_queue in queue.classes:
                for tenant, entries in cls_queue.tenant_entries():
                    count, oldest = stats.get((cls_queue.cls, tenant), (0, 0.0))
                    wait = max(now - min(e.arrival for e in entries), 0.0)
                    stats[(cls_queue.cls, tenant)] = (count + len(entries), max(oldest, wait))
        queues = [QueueStat(c, t, n, w) for (c, t), (n, w) in sorted(stats.items())]
        engines = [
            EngineStat(self._view(e, now), e.info.address, self.kv.blocks(e.engine_id), e.info.backend)
            for e in sorted(self.engines, key=lambda r: r.engine_id)
        ]
        return StateView(self.policy.name, queues, engines, self.queued_total(), len(self._leases))
