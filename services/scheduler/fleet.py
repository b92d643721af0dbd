"""The engine-facing state of the scheduler: which engines are connected
(engine_registry.py), which prefix blocks each one caches (kv_index.py),
the blocks promised to placements not yet in a load report
(reservations.py), the live leases, and the `EngineView`s placement reads.

Ownership rule: `EngineFleet` is owned by `SchedulerCore` and called only
from it (so only from the core's one thread, see core.py). It knows engines
and leases, never queues or requests' lifecycles: the core decides when a
lease opens or ends, the fleet keeps the books in step (engine lease sets,
reservations, service-time estimates) and answers what placement needs.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence, Set
from dataclasses import dataclass, field

from services.common.config import SchedulerConfig

from .classes import ClassTable
from .engine_registry import EngineInfo, EngineLoad, EngineRecord, EngineRegistry
from .fleet_index import FleetIndex
from .fleet_reads import FleetBooks, current_view, eligibility
from .kv_index import KvIndex
from .placement import EngineView, PlacementRequest
from .placement.candidates import CandidatePlan
from .placement.interfaces import view_of
from .records import AdmissionError, AdmitOptions, Lease, RejectReason
from .reservations import ReservationBook, blocks_needed
from .servable import check_fits, cold_start_refusal

__all__ = ["EngineFleet", "EngineStat", "Joined"]


@dataclass(frozen=True)
class EngineStat:
    """One engine as GetState shows it."""

    view: EngineView
    address: str
    cached_blocks: int
    backend: str
    incarnation: int = 0
    model_revision: str = ""
    spare: bool = False        # held as a warm spare (spares.py): placement skips it


@dataclass(frozen=True)
class Joined:
    """A registration: its token, and the older process of the id it
    superseded, if any, with that one's leases (ended)."""

    token: int
    superseded: EngineRecord | None = None
    lost: list[Lease] = field(default_factory=list)


class EngineFleet:
    def __init__(self, config: SchedulerConfig, started: float, retry_min: float,
                 classes: ClassTable | None = None, autoscaled: frozenset[str] = frozenset()) -> None:
        self._config = config
        self._classes = classes if classes is not None else ClassTable.from_config(config)
        self._started = started
        self._retry_min = retry_min
        # Models scaled from zero (scheduler.scaling.enabled: the configured
        # ones): with no engine, their requests wait for one to start. A
        # model nobody configured (a typo) is still refused after the grace.
        self.autoscaled = autoscaled
        self._registry = EngineRegistry(config.initial_service_seconds)
        self.kv = KvIndex()
        self.reservations = ReservationBook()
        # Engines sorted by the figures placement ranks on (fleet_index.py):
        # every change below to a report, a lease or a reservation touches it.
        self._index = FleetIndex(config.prefill_tokens_per_second)
        self._leases: dict[str, Lease] = {}
        # Leases of yielding classes (ClassRules.yields_room: Batch API lines)
        # now: placement skips the batch-yield scan while there are none.
        self.yielding_leases = 0
        # Blocks of preempted leases that an engine's last report still
        # counts as used: free for placement until its next report.
        self._freed: dict[str, int] = {}
        self._lease_ids = itertools.count(1)
        # Last time an engine for each model was seen: a model nobody serves
        # is accepted for engine_grace_seconds after that (or after start-up),
        # a replacement (a stream that lost its engine) engine_return_seconds.
        self._model_seen: dict[str, float] = {}
        # Engine ids an operator drained (kvmesh.v1.Admin DrainEngine),
        # registered or not: one that reconnects stays drained. Placement
        # never sees them (`views`), whatever filters a policy lists.
        self.admin_drained: set[str] = set()
        # Engine ids held as warm spares (spares.py owns the choice): placement
        # never sees them either. `epoch` counts joins, leaves and drains, so
        # the spare keeper re-ranks a model's engines only when they changed.
        self.spares: set[str] = set()
        self.epoch = 0
        # What a decision reads per engine it looks at (fleet_reads.py).
        self._books = FleetBooks(self._registry.records(), self._index.views, self.admin_drained,
                                 config.stale_report_seconds, self.spares)

    # ------------------------------------------------------------ registry

    def __iter__(self) -> Iterator[EngineRecord]:
        return iter(self._registry)

    def __len__(self) -> int:
        return len(self._registry)

    def get(self, engine_id: str) -> EngineRecord | None:
        return self._registry.get(engine_id)

    def current(self, engine_id: str, token: int) -> EngineRecord | None:
        """The engine's record if `token` is its current registration."""
        record = self._registry.get(engine_id)
        return record if record is not None and record.token == token else None

    def join(self, info: EngineInfo, now: float) -> Joined:
        """Register an engine (engine_registry.py's rules). When the hello
        superseded an older process of the id, that one's KV entries,
        reservations and leases are dropped as in `leave`; the ended leases
        come back in `Joined.lost`. Raises `DuplicateEngineError` /
        `SupersededEngineError` (nothing changes then)."""
        registration = self._registry.register(info, now)
        self._index.join(info.engine_id, info.model)   # re-keyed: a superseded one's leases go below
        if registration.replaced is not None:
            self.kv.drop_engine(info.engine_id)      # the new snapshot replaces it
        lost: list[Lease] = []
        if registration.superseded is not None:
            lost = self._forget(registration.superseded)
        self._model_seen[info.model] = now
        self.epoch += 1
        return Joined(registration.record.token, registration.superseded, lost)

    def report_load(self, engine_id: str, token: int, load: EngineLoad, now: float) -> bool | None:
        """Apply a report: None = not the engine's current registration (ignored);
        False = a fresh engine's load repeated (a heartbeat: no room changed)."""
        record = self.current(engine_id, token)
        if record is None:
            return None
        was_fresh = record.fresh(now, self._config.stale_report_seconds)
        changed = record.take_load(load, now) or not was_fresh
        self._index.touch(engine_id)
        self._freed.pop(engine_id, None)
        self.reservations.settle(engine_id, load.request_ids)
        # Re-keyed now, not at the next decision: at 1,024 engines and 10 admissions/s a decision
        # otherwise re-keyed ~180 reports (~10 ms, measured); now its own leases' engines.
        self._refresh(now)
        return changed

    def kv_events(
        self, engine_id: str, token: int, seq: int,
        stored: Sequence[int], removed: Sequence[int], cleared: bool,
    ) -> bool:
        """Apply KV events; True = ask the engine for a snapshot (Resync)."""
        if self.current(engine_id, token) is None:
            return False
        return self.kv.apply_events(engine_id, seq, stored, removed, cleared)

    def kv_snapshot(self, engine_id: str, token: int, seq: int, hashes: Sequence[int]) -> None:
        if self.current(engine_id, token) is not None:
            self.kv.apply_snapshot(engine_id, seq, hashes)

    def leave(self, engine_id: str, token: int, now: float) -> list[Lease] | None:
        """Forget an engine, its KV entries, reservations and leases at once.
        Returns the leases it held (now ended), or None when `token` is not
        the current registration (a stale stream's late close)."""
        record = self._registry.unregister(engine_id, token)
        if record is None:
            return None
        self._model_seen[record.info.model] = now  # its model was served until now
        self._index.leave(engine_id)
        self.spares.discard(engine_id)
        self.epoch += 1
        return self._forget(record)

    def _forget(self, record: EngineRecord) -> list[Lease]:
        """Drop what `record`'s process held: KV, reservations, leases."""
        engine_id = record.engine_id
        self.kv.drop_engine(engine_id)
        self.reservations.drop_engine(engine_id)
        self._freed.pop(engine_id, None)
        ended = [lease for lid in record.leases if (lease := self._leases.pop(lid, None))]
        self.yielding_leases -= sum(self._classes[lease.klass].yields_room for lease in ended)
        record.leases.clear()
        return ended

    def exclusions(self, exclude: Iterable[str], ran_on: dict[str, int],
                   waiting_since: float | None = None) -> frozenset[str]:
        """The engines a Replace excludes that still hold: not one whose
        process is newer than the one the request ran on there (the process
        that failed it is gone); nor, for a replacement excluding every
        engine of its model (`waiting_since`: its Replace), one whose backend
        worked since (a slow engine that recovered: RELIABILITY.md)."""
        def lifted(engine_id: str) -> bool:
            record = self._registry.get(engine_id)
            if record is None:
                return False
            ran = ran_on.get(engine_id, 0)
            return (ran > 0 and record.info.incarnation > ran) or (
                waiting_since is not None and record.progressed_since(waiting_since))
        return frozenset(e for e in exclude if not lifted(e))

    def drain(self, engine_id: str) -> bool:
        record = self._registry.get(engine_id)
        if record is None:
            return False
        record.draining = True
        self.epoch += 1
        return True

    def takes_work(self, record: EngineRecord) -> bool:
        """Serving, drained neither by the scheduler nor by an operator, not a warm spare."""
        return (record.load.serving and not record.draining and record.engine_id not in self.admin_drained
                and record.engine_id not in self.spares)

    def serves(self, model: str) -> bool:
        """Some engine of `model` is registered."""
        return bool(self._index.members(model))

    def fresh_count(self, now: float) -> int:
        return sum(1 for e in self._registry if e.fresh(now, self._config.stale_report_seconds))

    # ------------------------------------------------------------ leases

    def open_lease(
        self, options: AdmitOptions, engine: EngineRecord, reserved: int, cached: int, now: float, cls: int,
    ) -> Lease:
        """Lease `engine` to a request (placed in rank `cls`) and reserve its
        blocks (unless the engine's report already shows the request running)."""
        request_id, klass = options.request_id, options.klass
        lease = Lease(
            lease_id=f"lease-{next(self._lease_ids)}", request_id=request_id,
            engine_id=engine.engine_id, placed_at=now, reserved_blocks=reserved,
            cached_tokens=cached, prompt_tokens=options.prompt_tokens, cls=cls, klass=klass,
        )
        self.yielding_leases += self._classes[klass].yields_room
        if reserved and request_id not in engine.load.request_ids:
            self.reservations.reserve(engine.engine_id, request_id, reserved)
        engine.leases.add(lease.lease_id)
        self._leases[lease.lease_id] = lease
        self._index.touch(engine.engine_id)
        return lease

    def close_lease(self, lease: Lease, now: float, preempted: bool = False) -> None:
        """End a lease (idempotent); its duration feeds the engine's
        service-time estimate. A `preempted` lease's blocks count as free at
        once: from its reservation, or (once the engine reported it) from the
        engine's used blocks until its next report."""
        if self._leases.pop(lease.lease_id, None) is None:
            return
        self.yielding_leases -= self._classes[lease.klass].yields_room
        self._index.touch(lease.engine_id)
        released = self.reservations.release(lease.engine_id, lease.request_id)
        if preempted and not released and lease.reserved_blocks:
            self._freed[lease.engine_id] = self._freed.get(lease.engine_id, 0) + lease.reserved_blocks
        engine = self._registry.get(lease.engine_id)
        if engine is not None:
            engine.leases.discard(lease.lease_id)
            engine.observe_service(now - lease.placed_at)

    def lease_count(self) -> int:
        return len(self._leases)

    def leases_on(self, engine_id: str) -> list[Lease]:
        record = self._registry.get(engine_id)
        if record is None:
            return []
        return [lease for lid in record.leases if (lease := self._leases.get(lid)) is not None]

    # ------------------------------------------------------------ what placement reads

    def views(self, model: str, now: float) -> list[EngineView]:
        return [self._view(e, now) for e in self._registry
                if e.info.model == model and e.engine_id not in self.admin_drained and e.engine_id not in self.spares]

    def candidate_views(
        self, request: PlacementRequest, plan: CandidatePlan | None, holders: Callable[[int], Set[str]], now: float,
    ) -> list[EngineView] | None:
        """The views of the engines placement should score for `request`
        (placement/candidates.py), built now, in `views` order; [] = none
        passes the plan's checks; None = score them all (`views`)."""
        if plan is None:
            return None
        self._refresh(now)
        ids = self._index.candidates(request, plan, holders, self._eligibility(request, plan, now))
        if ids is None:
            return None
        books = self._books
        return [current_view(books, e, now) for e in ids]

    def _refresh(self, now: float) -> None:
        self._index.refresh(lambda engine_id: self._view(self._registry[engine_id], now))

    def _current(self, engine_id: str, now: float) -> EngineView:
        """`_view` of the engine now, from the index (fleet_reads.py)."""
        return current_view(self._books, engine_id, now)

    def other_views(
        self, request: PlacementRequest, plan: CandidatePlan, holders: Callable[[int], Set[str]],
        skip: Set[str], now: float,
    ) -> list[EngineView]:
        """The views of the engines outside `skip` (the candidates, which
        all failed) that might pass the policy's filters: screened on the
        index's views, so a fleet where none has room costs a cheap pass."""
        warm = holders(request.prefix_hashes[0]) if request.prefix_hashes else frozenset()
        need = request.prompt_tokens + request.max_tokens
        headroom = self._config.decode_headroom_tokens
        eligible = self._eligibility(request, plan, now)

        def may_pass(engine_id: str) -> bool:
            if not eligible(engine_id):
                return False
            view = self._index.view(engine_id)
            if "fits_context" in plan.checks and 0 < view.max_model_len < need:
                return False
            cached = request.prompt_tokens if engine_id in warm else 0   # at most all of it
            return "has_room" not in plan.checks or blocks_needed(
                request.prompt_tokens, request.max_tokens, cached, view.block_size, headroom) <= view.free_blocks

        return [self._current(e, now) for e in self._index.rest(request.model, skip, may_pass)]

    def _eligibility(self, request: PlacementRequest, plan: CandidatePlan, now: float) -> Callable[[str], bool]:
        """Whether an engine passes the request-independent filters the
        policy lists (fleet_reads.py), read live."""
        return eligibility(self._books, request, plan, now)

    def stats(self, now: float) -> list[EngineStat]:
        return [
            EngineStat(self._view(e, now), e.info.address, self.kv.blocks(e.engine_id), e.info.backend,
                       e.info.incarnation, e.info.model_revision, e.engine_id in self.spares)
            for e in sorted(self._registry, key=lambda r: r.engine_id)
        ]

    def _view(self, e: EngineRecord, now: float) -> EngineView:
        # Built at every load report (10,000 a second at 1,024 engines): the
        # record's parts read once into locals, the view made by `view_of`.
        info, load, config, engine_id = e.info, e.load, self._config, e.engine_id
        weight = info.weight if info.weight > 0 else 1.0
        slots, max_running, running, waiting = e.slots_taken, info.max_running, load.running, load.waiting
        occupancy = max(slots, running + waiting)
        prefill = load.queued_tokens / (config.prefill_tokens_per_second * weight)
        per_slot = e.service_seconds / max(1, max_running)
        excess = max(0, occupancy + 1 - max_running)
        queue_seconds = prefill + excess * per_slot
        # A P0 runs in the engine's P0 headroom ahead of classes that do not
        # delay it (ClassRules.delays_p0: batch lines): their leases do not
        # make it wait (else a batch on its warm engine sends the P0 to a
        # cold one, a whole prefill: BENCHMARKS.md, "Batch API"). Counted
        # only on a full engine: the common case stays O(1).
        behind = sum(1 for lid in e.leases if (lease := self._leases.get(lid)) is not None
                     and not self._classes[lease.klass].delays_p0) if excess else 0
        p0_queue_seconds = prefill + max(0, excess - behind) * per_slot
        return view_of({
            "engine_id": engine_id, "model": info.model, "serving": load.serving,
            "draining": e.draining or engine_id in self.admin_drained,
            "fresh": e.fresh(now, config.stale_report_seconds),
            "block_size": info.block_size, "blocks_total": load.blocks_total or info.total_blocks,
            "blocks_used": max(0, load.blocks_used - self._freed.get(engine_id, 0)),
            "blocks_reserved": self.reservations.reserved(engine_id),
            "leases": slots, "lease_limit": max_running + config.engine_queue_slack,
            "max_running": max_running, "running": running, "waiting": waiting,
            "queued_tokens": load.queued_tokens, "weight": weight,
            "max_model_len": info.max_model_len, "queue_seconds": queue_seconds, "p0_queue_seconds": p0_queue_seconds,
            "cached_blocks": load.cached_blocks, "p0_reserved_leases": config.p0_reserved_leases,
            "prefill_tokens_per_second": load.prefill_tokens_per_second, "step_seconds": load.step_seconds,
            "step_token_budget": load.step_token_budget,
            "unreported_tokens": self._unreported_tokens(e) if e.leases else 0,
        })

    def _unreported_tokens(self, e: EngineRecord) -> int:
        """Uncached prompt tokens of leases on `e` its last report does not
        show: placed since, so not in its queued_tokens yet. O(leases on e)."""
        reported = e.load.request_ids
        return sum(
            max(0, lease.prompt_tokens - lease.cached_tokens)
            for lid in e.leases
            if (lease := self._leases.get(lid)) is not None and lease.request_id not in reported
        )

    def check_servable(
        self, options: AdmitOptions, exclude: frozenset[str], now: float, replaced_at: float | None = None,
        arrival: float | None = None,
    ) -> bool:
        """Raise `AdmissionError` when no engine could ever take the request
        (as opposed to none having room right now). `replaced_at`: when the
        request's Replace came (None: not a replacement). True = no engine
        may take it now but one may come back in time: it waits for that
        (a replacement only; see `return_deadline`). `arrival`: when a queued
        request came; a model in `autoscaled` with no engine is scaled from
        zero, and the request waits for one to start until
        `cold_start_deadline(arrival)`."""
        # Lazily, in O(1) for the usual answer (an engine, not excluded, that fits):
        # it runs for every admission, and at 1,024 engines a list of them cost more than placing.
        engines = self._index.members(options.model)
        if engines:
            self._model_seen[options.model] = now
        else:
            seen = self._model_seen.get(options.model, self._started)
            # A replacement has streamed text already: it waits longer for an
            # engine of its model to come back (restarted by its supervisor).
            if replaced_at is None and arrival is not None and options.model in self.autoscaled:
                self._wait_for_cold_start(options.model, now, arrival)
                return False
            bound = self._config.engine_return_seconds if replaced_at is not None else self._config.engine_grace_seconds
            if now - seen > bound:
                raise AdmissionError(
                    RejectReason.NO_ENGINE,
                    f"no engine serves model {options.model!r}; check the model name or start "
                    "an engine for it",
                    self._retry_min,
                )
            return replaced_at is not None
        if all(e in exclude for e in engines):
            return self._wait_for_unexcluded(options.model, now, replaced_at)
        check_fits(options, (self._registry[e] for e in engines if e not in exclude),
                   self._config.decode_headroom_tokens)
        return False

    def _wait_for_cold_start(self, model: str, now: float, arrival: float) -> None:
        """Scale from zero: the request waits (queued, heartbeats on) for an
        engine to start, up to scheduler.scaling.cold_start_wait_seconds."""
        if now > self.cold_start_deadline(arrival):
            raise cold_start_refusal(model, self._config.scaling.cold_start_wait_seconds, self._retry_min)

    def cold_start_deadline(self, arrival: float) -> float:
        """Until when a request that came at `arrival` for a model with no
        engine waits for one to start (autoscaling on)."""
        return arrival + self._config.scaling.cold_start_wait_seconds

    def _wait_for_unexcluded(self, model: str, now: float, replaced_at: float | None) -> bool:
        """Every engine of `model` is excluded. A replacement waits, whatever
        the excluded engines report: one that still says serving may be
        stopped but not yet declared hung (a SIGSTOPped vLLM core), and its
        restart is a new process the exclusion does not cover (`exclusions`).
        It is refused only once `engine_return_seconds` passed since its
        Replace; anything else is refused at once."""
        if replaced_at is not None and now < self.return_deadline(replaced_at):
            return True
        raise AdmissionError(
            RejectReason.NO_ENGINE,
            f"every engine serving {model!r} is excluded by the replace"
            + ("" if replaced_at is None else
               f" and none came back within {self._config.engine_return_seconds:g} s"),
            self._retry_min,
        )

    def return_deadline(self, replaced_at: float) -> float:
        """Until when a replacement made at `replaced_at` waits for an engine
        to come back (scheduler.engine_return_seconds, whatever its class TTL)."""
        return replaced_at + self._config.engine_return_seconds
