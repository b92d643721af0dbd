"""How a higher class gets room now, at the two places it can be short:

  admission  a tenant at its queued cap: the newcomer displaces that
             tenant's newest queued request of its lowest class below the
             newcomer's (429 TENANT_FULL with Retry-After, saying why);
             with nothing lower queued the newcomer is refused as before.
             Class caps are per class, so nothing below can make room there
             (admission_limits.py refuses as before). Requests requeued
             after a preemption are never displaced: they have streamed
             tokens already. A class with a cap of its own (classes.py,
             CapScope.OWN: batch lines) is never displaced (it does
             not count in a tenant's cap) and displaces nothing: it is
             checked against its own cap alone.
  dispatch   the head of a model's queue is of a class in
             `scheduler.preempt_classes` and no engine can take it: one
             lower-class, unprotected lease is preempted on the engine
             where it runs best (the rule is preemption.py's), so the
             core's next placement attempt puts it there at once.
             Expendable classes (batch lines) go first, and are never
             protected by scheduler.max_preemptions (preemption.py says why).

Ownership rule: `RoomMaker` is owned by `SchedulerCore` and called only
from its dispatch and admission (so only from the core's one thread, see
core.py); it changes leases and records only through `RequestBook`.
"""

from __future__ import annotations

from collections.abc import Iterator

from services.common.config import MeshConfig

from .admission_limits import AdmissionLimits
from .class_stats import ClassLedger
from .classes import CapScope, ClassRules, ClassTable
from .events import Delivery
from .fleet import EngineFleet
from .placement import PlacementPolicy, PlacementRequest
from .preemption import Candidate, choose_victim
from .records import AdmitOptions, RequestRecord, RequestState
from .request_book import RequestBook
from .waiting import WaitingRoom

__all__ = ["RoomMaker", "placement_request"]


def placement_request(rec: RequestRecord, cls: int, rules: ClassRules) -> PlacementRequest:
    """What placement sees of a request of class `rules` waiting in rank `cls`."""
    o = rec.options
    return PlacementRequest(
        o.request_id, o.model, o.prompt_tokens, o.max_tokens, o.prefix_hashes, rec.exclude,
        priority=cls, reserved_slots=rules.reserved_slots)


class RoomMaker:
    def __init__(
        self, book: RequestBook, waiting: WaitingRoom, fleet: EngineFleet,
        policy: PlacementPolicy, limits: AdmissionLimits, ledger: ClassLedger, config: MeshConfig,
    ) -> None:
        self.classes: ClassTable = limits.classes
        self._book = book
        self._waiting = waiting
        self._fleet = fleet
        self.policy = policy  # the core swaps it (kvmesh.v1.Admin SetPlacementPolicy)
        self._limits = limits
        self._ledger = ledger
        self._hash_block_tokens = config.hash_block_tokens
        self._headroom = config.scheduler.decode_headroom_tokens
        self._max_preemptions = config.scheduler.max_preemptions

    def admit_room(self, options: AdmitOptions, cls: int, rate: float, now: float) -> list[Delivery]:
        """Queue room for a newcomer waiting in class `cls`: a class with its
        own cap against that cap only; anything else against the cap of the
        class it waits in, then its tenant's (displace_for). Raises the
        AdmissionError."""
        rules = self.classes[options.klass]
        if rules.cap_scope is CapScope.OWN:
            self._limits.check_cap(rules, self._waiting.apart_len(options.klass), rate)
            return []
        self._limits.check_cap(self.classes.at_rank(cls), self._waiting.class_len(cls), rate)
        return self.displace_for(options.tenant, cls, rate, now)

    def displace_for(self, tenant: str, cls: int, rate: float, now: float) -> list[Delivery]:
        """Room in `tenant`'s cap for a newcomer of class `cls`: nothing to do
        below the cap; at it, the displaced request's Rejected notice (it is
        finished); raises the newcomer's AdmissionError when nothing of a
        lower class is queued. O(models x classes x log n)."""
        tenant_len = self._waiting.tenant_len(tenant)
        refused = self._limits.tenant_full(tenant, tenant_len, rate)
        if refused is None:
            return []
        entry = self._waiting.displaceable(tenant, cls)
        if entry is None:
            raise refused
        err = self._limits.displaced_error(tenant, tenant_len, cls, rate)
        self._ledger.displaced(entry.base_class)
        return [(entry.request_id, self._book.reject(
            self._book[entry.request_id], now, err.reason, err.message, err.retry_after))]

    def preempt_for(self, rec: RequestRecord, cls: int, now: float) -> Delivery | None:
        """End one lower-class lease so `rec`, waiting in class `cls` with no
        room on any engine now, fits on the engine where it runs best.
        Returns the victim's Preempted notice, or None when nothing may be
        preempted (everything running is of its class or higher, or
        protected): then it waits as before."""
        # Eligible victims first (choose_victim's own test, applied early):
        # with none -- a stuck head among equal or protected classes, asked
        # again on every dispatch -- skip prefix matching and view completion.
        model = rec.options.model
        candidates = list(self._candidates(model, cls))
        if not candidates:
            return None
        request = placement_request(rec, cls, self.classes[rec.klass])
        views = self.policy.complete_views(
            request, self._fleet.views(model, now), self._fleet.kv, self._hash_block_tokens,
            self._headroom)
        choice = choose_victim(
            cls, views, candidates, self._max_preemptions,
            lambda view: self.policy.passes(request, view))
        if choice is None:
            return None
        victim = self._book[choice.victim.request_id]
        return (victim.options.request_id, self._book.preempt(victim, cls, self._max_preemptions, now))

    def _candidates(self, model: str, cls: int) -> Iterator[Candidate]:
        """Leases on `model`'s engines placed in a rank below `cls` whose
        request may be preempted: its class is expendable or it is below
        max_preemptions, and it is not DETACHED (nobody could answer Requeue)."""
        for e in self._fleet:
            if e.info.model != model:
                continue
            for lease in self._fleet.leases_on(e.engine_id):
                victim = self._book.get(lease.request_id) if lease.cls > cls else None
                if victim is None or victim.lease is not lease or victim.state is RequestState.DETACHED:
                    continue
                expendable = self.classes[lease.klass].expendable
                if expendable or victim.preemptions < self._max_preemptions:
                    yield Candidate(e.engine_id, lease.request_id, lease.cls, lease.placed_at,
                                    victim.preemptions, lease.reserved_blocks, expendable)
