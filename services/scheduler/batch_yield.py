"""Batch lines yield to interactive work: placement for a request of a class
that preempts (classes.py, ClassTable.preempts: a rank in
`scheduler.preempt_classes`) sees the lease slots and KV blocks that
preemptible leases of a yielding class (ClassRules.yields_room: Batch API
lines) hold as room, and takes one of those lines' slots on the engine it
chose when that engine has no really free one.

Why: batch lines may fill every lease slot but the P0-reserved one on each
engine. Without this, a second concurrent P0 whose cached context is on a
full engine passes the filters only on another engine and is placed there
cold (a whole prefill: 4-5x the TTFT of a warm placement), because the
general preemption (making_room.py) runs only when NO engine can take the
request. Ending a batch line costs the recompute of its prefix, nobody waits
on its stream and it resumes losslessly (Requeue), so a P0 should never pay a
cold prefill to spare one.

The rule, per placement of such a request:
  1. the fleet's views, each engine's preemptible batch leases (class below
     the request's, lease still current, not DETACHED) taken out of its
     lease count and its blocks freed (preemption.view_after, as if each had
     been preempted; running/waiting reduced alike), go through the policy
     unchanged -- filters, scorers and picker are the profile's own, so it
     picks the engine it would pick on a fleet idle of batch work;
  2. if the chosen engine passes the policy's filters as it really is, the
     request is placed there and nothing is preempted;
  3. otherwise, if the policy over the real views finds a placement with
     as many cached tokens (the context is warm on an engine with a free
     slot too), that one is taken and nothing is preempted: a line yields
     only to spare the request a colder placement;
  4. otherwise one batch line there is preempted (preemption.choose_victim
     over that engine's batch candidates: least progress lost first, and
     only a victim whose slot/blocks make the request fit) and the request
     takes its room in the same dispatch; its Preempted notice goes out with
     the placement, counted by RequestBook.preempt like any batch preemption;
  5. if no single batch line there makes room, the real views' placement
     stands (today's behaviour; the core may still preempt generally).
Ordinary P2 and P1 leases are never treated as room here: ending one costs a
person's or a pipeline's latency, so they keep the "preempt only when nothing
can take it" rule. A batch line or a request of another class is placed over
the real views exactly as before.

Ownership rule: owned by `SchedulerCore`, called only from its dispatch (the
core's one thread); leases change only through `RequestBook`.
"""

from __future__ import annotations

import dataclasses

from services.common.config import MeshConfig

from .classes import ClassRules
from .events import Delivery
from .fleet import EngineFleet
from .making_room import RoomMaker
from .placement import EngineView, Placement, PlacementRequest
from .preemption import Candidate, choose_victim, view_after
from .records import RequestState
from .request_book import RequestBook

__all__ = ["BatchYield"]


class BatchYield:
    def __init__(self, book: RequestBook, fleet: EngineFleet, room: RoomMaker, config: MeshConfig) -> None:
        self._book = book
        self._fleet = fleet
        self._room = room  # its `policy` is the current one (the core swaps it)
        self._classes = room.classes
        self._hash_block_tokens = config.hash_block_tokens
        self._headroom = config.scheduler.decode_headroom_tokens
        self._max_preemptions = config.scheduler.max_preemptions

    def place(self, request: PlacementRequest, rules: ClassRules, now: float, out: list[Delivery],
              ) -> Placement | None:
        """The policy's placement for `request` (of class `rules`, waiting in
        rank request.priority); a batch line it preempted to make room goes
        into `out`."""
        # No yielding lease anywhere (the usual case): no scan of the fleet's leases.
        yields = self._fleet.yielding_leases and self._classes.preempts(rules.klass, request.priority)
        lines = self._candidates(request) if yields else {}
        if not lines:
            return self._place_indexed(request, now)
        views = self._fleet.views(request.model, now)
        # a trial: the approximate prefix memory learns only the placement taken
        wanted = self._place(request, [_without(v, lines.get(v.engine_id, [])) for v in views], False)
        if wanted is None:
            return self._place(request, views)
        engine = self._completed(request, views, wanted.view.engine_id)
        if engine is not None and self._room.policy.passes(request, engine):
            return self._taken(request, wanted)  # a really free slot there: nobody yields
        plain = self._place(request, views, False)
        if plain is not None and plain.cached_tokens >= wanted.cached_tokens:
            return self._taken(request, plain)  # as warm elsewhere without taking a slot
        if engine is not None and self._preempt_on(request, engine, lines.get(engine.engine_id, []), now, out):
            return self._taken(request, wanted)
        return None if plain is None else self._taken(request, plain)

    def has_room(self, request: PlacementRequest, now: float) -> bool:
        """Whether the policy would place `request` now in a free slot (no
        preemption, nothing remembered): a trial, for room left to another
        replica (dispatch.py, peer_heads.py)."""
        return self._place_indexed(request, now, remember=False) is not None

    def _place_indexed(self, request: PlacementRequest, now: float, remember: bool = True) -> Placement | None:
        """The policy's placement over the candidates the fleet's indexes
        give (placement/candidates.py); when none of them takes it, over the
        other engines that might (the full scan's answer, "no room now" included)."""
        policy, plan = self._room.policy, self._room.policy.plan
        holders = policy.prefix_holders(self._fleet.kv)
        views = self._fleet.candidate_views(request, plan, holders, now)
        if views is None or plan is None:
            return self._place(request, self._fleet.views(request.model, now), remember)
        if not views:
            return None     # no engine of the model passes the policy's checks
        placement = self._place(request, views, remember)
        if placement is not None:
            return placement
        rest = self._fleet.other_views(request, plan, holders, {v.engine_id for v in views}, now)
        return self._place(request, rest, remember) if rest else None

    def _place(self, request: PlacementRequest, views: list[EngineView], remember: bool = True,
               ) -> Placement | None:
        return self._room.policy.place(request, views, self._fleet.kv, self._hash_block_tokens, self._headroom,
                                       remember)

    def _taken(self, request: PlacementRequest, placement: Placement) -> Placement:
        self._room.policy.remember(request, placement.view.engine_id)
        return placement

    def _completed(self, request: PlacementRequest, views: list[EngineView], engine_id: str) -> EngineView | None:
        """The engine as it really is, completed for the request."""
        real = [v for v in views if v.engine_id == engine_id]
        completed = self._room.policy.complete_views(
            request, real, self._fleet.kv, self._hash_block_tokens, self._headroom)
        return completed[0] if completed else None

    def _candidates(self, request: PlacementRequest) -> dict[str, list[Candidate]]:
        """Preemptible leases of yielding classes per engine serving the request's model."""
        found: dict[str, list[Candidate]] = {}
        for engine in self._fleet:
            if engine.info.model != request.model:
                continue
            for lease in self._fleet.leases_on(engine.engine_id):
                line = self._book.get(lease.request_id)
                rules = self._classes[lease.klass]
                if (line is not None and rules.yields_room and line.lease is lease
                        and lease.cls > request.priority and line.state is not RequestState.DETACHED):
                    found.setdefault(engine.engine_id, []).append(Candidate(
                        engine.engine_id, lease.request_id, lease.cls, lease.placed_at,
                        line.preemptions, lease.reserved_blocks, rules.expendable))
        return found

    def _preempt_on(
        self, request: PlacementRequest, engine: EngineView, lines: list[Candidate], now: float,
        out: list[Delivery],
    ) -> bool:
        """Preempt the batch line on `engine` whose room lets the request pass
        there (victim rule: preemption.py); its Preempted notice into `out`.
        False when no single line makes room."""
        policy = self._room.policy
        choice = choose_victim(request.priority, [engine], lines, self._max_preemptions,
                               lambda view: policy.passes(request, view))
        if choice is None:
            return False
        victim = self._book[choice.victim.request_id]
        out.append((victim.options.request_id,
                    self._book.preempt(victim, request.priority, self._max_preemptions, now)))
        return True


def _without(view: EngineView, lines: list[Candidate]) -> EngineView:
    """The engine as it would be with these batch lines preempted."""
    for line in lines:
        view = view_after(view, line)
    gone = len(lines)
    running = max(0, view.running - gone)
    waiting = max(0, view.waiting - max(0, gone - view.running))
    return dataclasses.replace(view, running=running, waiting=waiting)
