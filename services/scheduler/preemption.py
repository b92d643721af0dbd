"""Which running request gives its slot to a waiting request of a higher
class: a pure function over engine views and lease candidates, so the rule
is unit-testable without a core.

The core (core.py) asks only when the head of a model's queue is of a class
in `scheduler.preempt_classes` and no engine can take it now; batch_yield.py
asks it for one engine, over that engine's batch lines, when such a request's
placement chose an engine full of them. A candidate is
a live lease on an engine serving the model whose class (the class it was
placed in, after aging) is strictly lower than the newcomer's, and whose
request was preempted fewer than `scheduler.max_preemptions` times (after
that it is protected and runs to the end).

Engine first, then victim:
  engine  where the newcomer runs best: the longest cached prefix for it
          (fewer prompt tokens to prefill, so the fastest first token), then
          the fewest leases, then the shortest estimated queue, then the
          engine id (deterministic);
  victim  on that engine, the lowest class first (P2 before near-real-
          time work), then the least progress lost -- the most recently
          placed lease, which has generated the fewest tokens, so the
          fewest are recomputed when it resumes -- then the request id for
          determinism. A candidate is taken only if ending its lease lets
          the newcomer pass the placement filters on that engine (`fits`);
          engines where no single victim makes room are skipped.
Candidates of an expendable class (classes.py, ClassRules.expendable: batch
lines) go first, fleet-wide: the rule above runs over them alone, and only
when none of them makes room over all candidates. Nobody waits on a batch
line's stream and its deadline is hours away, so ending it costs only the
recompute of its prefix; ending an ordinary P2 stream costs a person or a
pipeline latency. For the same reason expendable candidates are never
protected by `max_preemptions`: a batch line yields as often as interactive
work needs its slot (it resumes from its last token each time), which is
what "fills idle capacity" promises.
Preempting one victim per placement keeps each decision small and visible;
the next queue head asks again.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .placement import EngineView

__all__ = [
    "Candidate", "Choice", "choose_victim", "engine_order", "fits_after", "view_after", "victim_order",
]


@dataclass(frozen=True)
class Candidate:
    """A running request that might give up its lease."""

    engine_id: str
    request_id: str
    cls: int                   # the class its lease was placed in
    placed_at: float
    preemptions: int           # times its request was preempted already
    blocks: int                # blocks its lease accounts for on the engine
    expendable: bool = False   # its class's ClassRules.expendable: preempted first, never protected


@dataclass(frozen=True)
class Choice:
    view: EngineView           # the engine, as it is before the preemption
    victim: Candidate


def engine_order(view: EngineView) -> tuple[int, int, float, str]:
    """Sort key: best engine for the newcomer first."""
    return (-view.prefix_blocks, view.leases, view.queue_seconds, view.engine_id)


def victim_order(candidate: Candidate) -> tuple[bool, int, float, str]:
    """Sort key: the victim to take first on one engine."""
    return (not candidate.expendable, -candidate.cls, -candidate.placed_at, candidate.request_id)


def view_after(view: EngineView, victim: Candidate) -> EngineView:
    """The engine as the newcomer sees it once `victim`'s lease ended: one
    lease fewer, the victim's blocks free (taken from its reservation or,
    once reported, from the used blocks)."""
    from_reserved = min(victim.blocks, view.blocks_reserved)
    from_used = min(victim.blocks - from_reserved, view.blocks_used)
    return dataclasses.replace(
        view, leases=max(0, view.leases - 1), blocks_reserved=view.blocks_reserved - from_reserved,
        blocks_used=view.blocks_used - from_used)


def fits_after(priority: int) -> Callable[[EngineView], bool]:
    """The capacity test of the default filters (lease slots and blocks)."""
    def fits(view: EngineView) -> bool:
        return view.leases < view.lease_limit_for(priority) and view.blocks_needed <= view.free_blocks
    return fits


def choose_victim(
    newcomer_cls: int,
    engines: Sequence[EngineView],
    candidates: Sequence[Candidate],
    max_preemptions: int,
    fits: Callable[[EngineView], bool] | None = None,
) -> Choice | None:
    """The (engine, victim) to preempt for a newcomer of class
    `newcomer_cls`, or None when no lower-class, unprotected lease would make
    room. `engines` are views completed for the newcomer (prefix_blocks,
    blocks_needed); `fits` says whether the newcomer could be placed on a
    view (default: `fits_after(newcomer_cls)`)."""
    fits = fits or fits_after(newcomer_cls)
    eligible = [c for c in candidates
                if c.cls > newcomer_cls and (c.expendable or c.preemptions < max_preemptions)]
    first = [c for c in eligible if c.expendable]
    for tier in ([first, eligible] if first else [eligible]):
        choice = _choose_in(engines, tier, fits)
        if choice is not None:
            return choice
    return None


def _choose_in(
    engines: Sequence[EngineView], candidates: Sequence[Candidate], fits: Callable[[EngineView], bool],
) -> Choice | None:
    """Engine first (engine_order), then victim (victim_order)."""
    by_engine: dict[str, list[Candidate]] = {}
    for c in candidates:
        by_engine.setdefault(c.engine_id, []).append(c)
    for view in sorted((v for v in engines if v.engine_id in by_engine), key=engine_order):
        for victim in sorted(by_engine[view.engine_id], key=victim_order):
            if fits(view_after(view, victim)):
                return Choice(view, victim)
    return None
