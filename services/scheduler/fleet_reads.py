"""What one placement decision reads of each engine it looks at: whether the
engine may take the request before its size and prefix count
(`eligibility`), and its view now (`current_view`).

Why a module of its own: a decision asks both for 20-60 engines (the fleet
index's walks, placement/candidates.py), so what depends only on the request
and the policy's plan -- which checks are on, the request's slot class -- is
worked out once per decision (`eligibility` returns the per-engine test),
and the books are read as plain mappings, not through methods per engine.

Called only from `EngineFleet` (fleet.py), on the scheduler core's thread.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Set
from dataclasses import dataclass

from .engine_registry import EngineRecord
from .placement import EngineView, PlacementRequest
from .placement.candidates import CandidatePlan

__all__ = ["FleetBooks", "current_view", "eligibility"]

_NONE: frozenset[str] = frozenset()


@dataclass(frozen=True)
class FleetBooks:
    """The fleet's live books these reads use (the mappings are the fleet's own, read only)."""

    records: Mapping[str, EngineRecord]   # engine id -> registration (engine_registry.py)
    views: Mapping[str, EngineView]       # engine id -> view as of its last re-key (fleet_index.py)
    drained: Set[str]                     # engine ids an operator drained
    stale_after: float                    # scheduler.stale_report_seconds
    spares: Set[str] = frozenset()        # engine ids held as warm spares (spares.py)


def eligibility(books: FleetBooks, request: PlacementRequest, plan: CandidatePlan, now: float,
                ) -> Callable[[str], bool]:
    """The test an engine passes when it passes the request-independent
    filters the policy lists (and, as placement always applies it, the
    P0-reserved slots rule), read live."""
    checks, records, views, drained, stale_after = plan.checks, books.records, books.views, books.drained, \
        books.stale_after
    excluded = request.exclude if "not_excluded" in checks else _NONE
    spares = books.spares
    serving, not_draining, fresh = "serving" in checks, "not_draining" in checks, "fresh" in checks
    slot_class = request.slot_priority if "lease_slots" in checks else None
    reserved_slots = request.reserved_slots

    def eligible(engine_id: str) -> bool:
        if engine_id in drained or engine_id in excluded or engine_id in spares:
            return False
        record = records[engine_id]
        if (serving and not record.load.serving) or (not_draining and record.draining):
            return False
        if fresh and ((last := record.last_report_at) is None or not now - last <= stale_after):  # record.fresh
            return False
        leases, view = record.slots_taken, views[engine_id]
        if slot_class is not None and leases >= view.lease_limit_for(slot_class):
            return False
        return reserved_slots or leases < view.lease_limit_for(1)

    return eligible


def current_view(books: FleetBooks, engine_id: str, now: float) -> EngineView:
    """The engine's view now, from the index: as of the last change of its
    report, leases or reservations, with what changes unannounced -- the
    report's freshness, a drain -- read live."""
    view, record = books.views[engine_id], books.records[engine_id]
    fresh = record.fresh(now, books.stale_after)
    draining = record.draining or engine_id in books.drained
    if view.fresh == fresh and view.draining == draining:
        return view
    return dataclasses.replace(view, fresh=fresh, draining=draining)
