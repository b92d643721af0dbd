"""Which engines a placement decision scores: candidates from indexes, so a
decision costs O(K), not O(engines of the model).

Why: the framework scored every engine's view for every request, and a view
is rebuilt, completed, filtered, scored and sorted per engine: 2 ms at 32
engines, 10 ms at 256, 52 ms at 1,024 (one core placed ~20 requests/s;
BENCHMARKS.md, "Control plane capacity"). Yet a policy's choice depends on
few engines: those holding the request's prefix, and the best ones by each
figure the policy ranks on. So the candidates are

  * warm: the engines holding the prompt's first block (the policy's own
    prefix source: KV index, in-flight overlay, approximate memory) -- all
    of them while at most K do; beyond that (a hot context cached on many
    engines, a system prompt cached everywhere) the K best holders of the
    deepest block any engine holds and the K best of the first block's
    holders, "best" by the picker's figure (predicted_ttft: "ready"; else
    the policy's first figure). Why K and not all: a context warm on 32 of
    1,024 engines made every one of them a candidate, ~7-10 us each to
    complete, score and pick (BENCHMARKS.md, "Third pass"); among holders
    of equally deep prefixes the picker's figure orders them as the picker
    does, so the best is kept and only near-ties beyond the K-th change;
  * for each figure the policy ranks on (its scorers' and its picker's,
    `ORDER_OF_SCORER` / `ORDER_OF_PICKER`), the K best engines by that
    figure that pass the policy's request-independent filters (serving,
    fresh, not draining, not excluded, a lease slot for the request's class).

The figures are kept sorted per model by the fleet (fleet_index.py) and
updated from the engines whose reports or leases changed since the last
decision, never rebuilt per decision; only the candidates' views are built
and scored, by the same filters, scorers and picker as before.

What is exact and what is bounded (tests/unit/scheduler/test_candidates.py):
  * a model with at most 2 K engines, a policy with an unknown scorer or
    picker, or round_robin (its turn order spans every engine) is scanned
    whole, exactly as before;
  * max_score policies: each scorer's score falls with its figure, so an
    engine outside the candidates scores at most U = sum over scorers of
    weight x (its score at the K-th engine of its figure) / sum of weights;
    the choice is the candidates' best, so it is at most max(0, U - chosen)
    below the full scan's best, and equal whenever that engine is a candidate;
  * predicted_ttft: every warm engine is a candidate (up to K of them;
    beyond that the K best by "ready" of the deepest and of the first block's holders),
    and a cold engine's predicted TTFT is its "ready" figure (the predicted
    TTFT of an empty prompt) + the prompt's prefill at its speed + at most
    one extra step; with one speed across the model (engines of one model run
    alike) the best cold engine is therefore the first of that figure, and the
    choice is the full scan's whenever the near-ties it breaks by score number
    at most K. Otherwise (mixed speeds) its prediction exceeds the full
    scan's choice's by at most 2 x the margin + the tie window + the gap
    between the best cold candidate and the least any other engine could
    cost (the K-th "ready" figure + the prompt at the fastest speed).
Not covered by a figure: the eviction charge (live blocks) of a cold
engine, and an unmeasured engine's speed borrowed from its peers (the
median among the candidates, not the fleet). Queueing figures take the
lower of a P0's and anyone's, so they bound both.

If the candidates yield no placement, the other engines are screened
cheaply (the checks above, plus fits_context and has_room for a cold
placement -- or, on an engine holding the prefix, for none of the prompt
cached) and the policy runs over those that might pass: the answer,
including "nothing has room now", is the full scan's, and a saturated fleet
costs a cheap pass over its engines per attempt, not a full scan.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .interfaces import EngineView, PlacementRequest
from .predicted import predicted_ttft

__all__ = [
    "ELIGIBILITY_FILTERS",
    "FIT_FILTERS",
    "ORDER_KEYS",
    "ORDER_OF_PICKER",
    "ORDER_OF_SCORER",
    "CandidatePlan",
    "plan_for",
]

# Filters whose answer does not depend on the request's size or prefix: the
# index walks apply them (those the policy lists) while taking the K best.
ELIGIBILITY_FILTERS = frozenset({"serving", "fresh", "not_draining", "not_excluded", "lease_slots"})
# Filters the screening of the other engines applies too (request-dependent, cheap to bound).
FIT_FILTERS = frozenset({"fits_context", "has_room"})

_EMPTY = PlacementRequest(request_id="", model="", prompt_tokens=0, max_tokens=0)


def _load(view: EngineView, fallback: float) -> float:
    """LoadScorer's ratio: requests per unit of weighted lease slots."""
    return (view.occupancy + 1) / (max(view.weight, 1e-9) * max(view.lease_limit, 1))


def _kv_fill(view: EngineView, fallback: float) -> float:
    """KvUsageScorer's fill before the request's own blocks."""
    if view.blocks_total <= 0:
        return math.inf
    return (view.blocks_used + view.blocks_reserved) / view.blocks_total


def _cache_fill(view: EngineView, fallback: float) -> float:
    """CacheSpreadScorer's share of blocks holding cached prefixes."""
    return view.cached_blocks / view.blocks_total if view.blocks_total > 0 else math.inf


def _queue(view: EngineView, fallback: float) -> float:
    """The smaller of the two queueing estimates (a P0's or anyone's)."""
    p0 = view.p0_queue_seconds
    return view.queue_seconds if p0 is None else min(p0, view.queue_seconds)


def _weight(view: EngineView, fallback: float) -> float:
    return -view.weight


def _ready(view: EngineView, fallback: float) -> float:
    """predicted_ttft of an empty prompt: slot wait, the tokens ahead and a
    step (placement/predicted.py); a cold request adds its prefill. With a
    P0's slot wait when shorter (batch lines it runs ahead of), so that the
    figure is a lower bound of what any class's request is predicted."""
    ready = predicted_ttft(_EMPTY, view, fallback)
    p0 = view.p0_queue_seconds
    if p0 is None or p0 >= view.queue_seconds:
        return ready
    ahead = view.queued_tokens / (fallback * max(view.weight, 1e-9))
    return ready - max(0.0, view.queue_seconds - ahead) + max(0.0, p0 - ahead)


# Figure name -> key (lower is better) of a fleet view, given the fallback prefill speed.
ORDER_KEYS: dict[str, Callable[[EngineView, float], float]] = {
    "load": _load, "kv_fill": _kv_fill, "cache_fill": _cache_fill,
    "queue": _queue, "weight": _weight, "ready": _ready,
}
# The figure each built-in scorer ranks on ("prefix": the warm candidates).
ORDER_OF_SCORER: dict[str, str | None] = {
    "load": "load", "kv_usage": "kv_fill", "cache_spread": "cache_fill",
    "queue_time": "queue", "weight": "weight", "prefix": None,
}
# The figures each built-in picker ranks on; round_robin is absent: it needs every engine.
ORDER_OF_PICKER: dict[str, tuple[str, ...]] = {
    "max_score": (), "predicted_ttft": ("ready",), "predicted_ttft_plain": ("ready",),
    "sticky_until_saturated": ("queue",),
}


@dataclass(frozen=True)
class CandidatePlan:
    """How one policy takes its candidates."""

    orders: tuple[str, ...]        # figures, each giving its K best engines
    checks: frozenset[str]         # filters of ELIGIBILITY_FILTERS | FIT_FILTERS the policy lists
    k: int                         # engines per figure (> 0)

    warm: str = "load"             # the figure the warm holders are ranked by beyond `warm_cap`

    @property
    def warm_cap(self) -> int:
        """Warm engines taken whole up to this many; beyond, this many best by `warm`."""
        return self.k

    def scans_whole(self, engines: int) -> bool:
        """A model this small is scanned whole: exact and as cheap."""
        return engines <= 2 * self.k


def plan_for(scorers: Sequence[str], picker: str, filters: Sequence[str], k: int) -> CandidatePlan | None:
    """The plan of a policy with these plugins; None = scan every engine
    (k 0, or a plugin whose figure is unknown)."""
    if k <= 0 or picker not in ORDER_OF_PICKER or any(s not in ORDER_OF_SCORER for s in scorers):
        return None
    orders: list[str] = []
    for name in [ORDER_OF_SCORER[s] for s in scorers] + list(ORDER_OF_PICKER[picker]):
        if name is not None and name not in orders:
            orders.append(name)
    if not orders:
        orders.append("load")
    # The picker's own figure ranks the warm holders as the picker would.
    warm = ORDER_OF_PICKER[picker][0] if ORDER_OF_PICKER[picker] else orders[0]
    return CandidatePlan(tuple(orders), (ELIGIBILITY_FILTERS | FIT_FILTERS) & frozenset(filters), k, warm)
