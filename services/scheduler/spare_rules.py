"""The arithmetic of warm spares (spares.py keeps the state): whether a
model's queued work of a class would miss its first-token target on the
engines serving now, whether the model is calm enough to hold one engine
back, and the one order every scheduler replica ranks a model's engines in.

Pure functions over engine views and figures, so the rules are tested on
numbers alone (tests/unit/scheduler/test_spare_rules.py).

Predicted first token of a class's queued work, on the serving engines:

    head  = waited + ahead / slot rate + best TTFT
    tail  = (queued up to it - 1) / slot rate + best TTFT

* waited: how long the class's head has waited already (it counts against
  the target: the target is arrival -> first token);
* ahead: requests of higher classes queued (they leave first);
* slot rate: lease slots freed per second by the serving engines,
  sum of max_running / service time (the fleet's EWMA of lease durations);
* best TTFT: the lowest `predicted_ttft` (placement/predicted.py) over the
  serving engines, cold (no prefix counted), the engines' measured speeds,
  borrowed from peers where unmeasured -- what the head would see placed now;
* tail: the class's newest request, which waits for everything queued before it.

It misses when max(head, tail) > the class's target. No serving engine that
may take work (all stale, draining or spare) = an infinite prediction.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

from .placement import EngineView, PlacementRequest
from .placement.predicted import predicted_ttft, with_peer_speed

__all__ = ["ClassBacklog", "Serving", "calm", "engine_order_key", "predicted_first_token"]


@dataclass(frozen=True)
class ClassBacklog:
    """One class's queued work for one model."""

    rank: int                  # 0 = P0
    waited: float              # seconds the class's head has waited
    ahead: int                 # requests of higher classes queued before it
    queued: int                # requests of this class queued
    head: PlacementRequest     # the class's head, as placement would see it


@dataclass(frozen=True)
class Serving:
    """One engine that may take work now, with the figures the rules read."""

    view: EngineView
    service_seconds: float     # the fleet's EWMA of its lease durations


def _slot_rate(serving: Sequence[Serving]) -> float:
    """Lease slots the engines free per second."""
    return sum(max(1, s.view.max_running) / max(s.service_seconds, 1e-6) for s in serving)


def predicted_first_token(backlog: ClassBacklog, serving: Sequence[Serving], fallback_tps: float) -> float:
    """Seconds from the class's arrival to its first token, the later of its
    head's and its tail's (module docstring); inf with no engine serving."""
    if not serving:
        return math.inf
    views = with_peer_speed([s.view for s in serving])
    best = min(predicted_ttft(backlog.head, v, fallback_tps) for v in views)
    rate = _slot_rate(serving)
    head = backlog.waited + backlog.ahead / rate + best
    tail = (backlog.ahead + backlog.queued - 1) / rate + best
    return max(head, tail)


def calm(serving: Sequence[Serving], queued: int, utilization: float) -> bool:
    """The model can do without one of its serving engines: nothing queued,
    and the lease slots taken fit in all the serving engines but the largest
    at `utilization` of their max_running."""
    if queued > 0 or len(serving) < 2:
        return False
    taken = sum(s.view.leases for s in serving)
    sizes = sorted(max(1, s.view.max_running) for s in serving)
    return taken <= utilization * sum(sizes[:-1])


_DIGITS = re.compile(r"(\d+)")


def engine_order_key(engine_id: str) -> tuple[tuple[int, int | str], ...]:
    """The order every replica ranks a model's engines in: by id, numbers
    compared as numbers (engine-2 before engine-10). The spares are the
    last of this order, promoted from the first of them."""
    return tuple((0, int(part)) if part.isdigit() else (1, part) for part in _DIGITS.split(engine_id) if part)
