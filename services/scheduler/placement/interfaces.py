"""The placement contracts. Plugins are small and pure: they read the views
they are given and return an answer; the framework (policies.py) computes
views, applies weights, clamps scores, shuffles ties and counts.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

__all__ = [
    "EngineView", "Filter", "Picker", "PickerState", "PlacementRequest", "ScoredEngine", "Scorer", "view_of",
]


@dataclass(frozen=True)
class PlacementRequest:
    request_id: str
    model: str
    prompt_tokens: int
    max_tokens: int
    prefix_hashes: tuple[int, ...] = ()
    exclude: frozenset[str] = frozenset()
    # The request's class now (0 = P0), after aging.
    priority: int = 1
    # Its class may fill the P0-reserved lease slots once it waits in P0
    # (scheduler/classes.py, ClassRules.reserved_slots; batch lines may not:
    # the framework enforces it even for a profile without `lease_slots`).
    reserved_slots: bool = True

    @property
    def slot_priority(self) -> int:
        """The class whose lease slots the request may fill: without
        reserved slots never P0's (no P0-reserved slot)."""
        return self.priority if self.reserved_slots else max(self.priority, 1)


@dataclass(frozen=True)
class EngineView:
    """One engine as placement sees it for one request (all counts >= 0)."""

    engine_id: str
    model: str
    serving: bool
    draining: bool
    fresh: bool
    block_size: int
    blocks_total: int
    blocks_used: int
    blocks_reserved: int
    leases: int
    lease_limit: int            # max_running + engine_queue_slack
    max_running: int
    running: int
    waiting: int
    queued_tokens: int
    weight: float               # > 0
    max_model_len: int          # 0 = unknown
    queue_seconds: float        # estimated queueing before a new request starts
    prefix_blocks: int = 0      # leading prefix hashes the engine holds (per prefix source)
    cached_tokens: int = 0      # prompt tokens expected cached on it
    blocks_needed: int = 0      # blocks the request would newly take on it
    cached_blocks: int = 0      # blocks in its prefix cache (last report): how many contexts it keeps
    p0_reserved_leases: int = 0  # of lease_limit, slots only P0 may take
    # Estimated queueing for a P0, which leases of classes that do not delay
    # it (batch lines) never delay (it runs in the engine's P0 headroom):
    # their leases left out. None = queue_seconds.
    # The framework puts it in queue_seconds for a P0 request (policies.py).
    p0_queue_seconds: float | None = None
    # The engine's measured step speed (LoadReport 310-312; 0 = unknown: a
    # policy falls back to scheduler.prefill_tokens_per_second).
    prefill_tokens_per_second: float = 0.0
    step_seconds: float = 0.0
    step_token_budget: int = 0
    # Uncached prompt tokens of our leases there that its last report does
    # not show yet (placed since): work ahead of a new request not yet in
    # queued_tokens.
    unreported_tokens: int = 0
    # Blocks of prefixes the policy placed here within the last few seconds
    # (sessions about to come back; placement/live.py), at least its used
    # blocks; 0 when the policy does not track them.
    live_blocks: int = 0

    @property
    def free_blocks(self) -> int:
        return self.blocks_total - self.blocks_used - self.blocks_reserved

    def unreserved_room(self) -> bool:
        """A slot is free below the P0-reserved ones (policies.py applies it
        to every placement of a request without reserved slots)."""
        return self.leases < self.lease_limit_for(1)

    def lease_limit_for(self, priority: int) -> int:
        """Lease slots a request of class `priority` may fill."""
        limit = self.lease_limit
        if priority == 0:
            return limit
        # min(p0_reserved_leases, limit - 1) written out: twice per candidate per decision.
        reserved = self.p0_reserved_leases
        return limit - (reserved if reserved < limit - 1 else limit - 1)

    @property
    def occupancy(self) -> int:
        """Requests on it: the larger of our leases and what it reports."""
        return max(self.leases, self.running + self.waiting)


def view_of(fields: dict[str, Any]) -> EngineView:
    """`EngineView(**fields)` without running the frozen __init__: `fields`
    (every field without a default; the dict is taken, not copied) becomes
    the view's own field dict, the defaults filled in. Why: the fleet builds
    a view at every load report (10,000 a second at 1,024 engines), and the
    frozen __init__ of 32 fields took 8.4 us of the 14 a view cost."""
    for name, default in _VIEW_DEFAULTS:
        fields.setdefault(name, default)
    view = object.__new__(EngineView)
    object.__setattr__(view, "__dict__", fields)
    return view


_VIEW_DEFAULTS: tuple[tuple[str, Any], ...] = tuple(
    (f.name, f.default) for f in dataclasses.fields(EngineView) if f.default is not dataclasses.MISSING)


class ScoredEngine(NamedTuple):
    """One candidate and its score. A named tuple, not a frozen dataclass:
    the framework makes one per candidate per decision, and a frozen
    dataclass's __init__ cost as much as a scorer (measured)."""

    view: EngineView
    score: float                # weighted mean of clamped scores, in [0, 1]


@dataclass
class PickerState:
    """A policy's mutable state, owned by the framework, handed to its picker."""

    rng: random.Random
    # Smooth weighted round-robin: engine id -> current weight.
    rr_current: dict[str, float] = field(default_factory=dict)


class Filter(Protocol):
    """Keeps the engines that may take the request.

    Promise: returns a subset of `engines` in their input order (possibly
    empty; [] for []) and nothing else; pure.
    """

    name: str

    def filter(self, request: PlacementRequest, engines: Sequence[EngineView]) -> list[EngineView]: ...


class Scorer(Protocol):
    """Rates each engine for the request; higher is better.

    Promise: a value in [0, 1] for each engine id of `engines` ({} for []);
    equal engines get equal scores; pure. The framework still clamps to
    [0, 1] and counts a missing engine as 0.
    """

    name: str

    def score(self, request: PlacementRequest, engines: Sequence[EngineView]) -> Mapping[str, float]: ...


class Picker(Protocol):
    """Chooses one engine.

    Promise: returns the view of one of `candidates`, or None iff
    `candidates` is empty. Candidates arrive sorted by score, best first, with
    ties in a seeded random order (shuffle, then stable sort), so
    "the first" is a fair max-score choice. May update `state` only.
    """

    name: str

    def pick(
        self, request: PlacementRequest, candidates: Sequence[ScoredEngine], state: PickerState
    ) -> EngineView | None: ...
