"""Named placement policies and the framework that runs them.

A policy is a profile (filters, scorer weights, picker, prefix source) built
from the one plugin registry. The framework:
  1. completes each engine view for the request: prefix blocks held (from
     the policy's prefix source), cached tokens, blocks the request needs;
  2. runs the filters in order;
  3. clamps each scorer's values to [0, 1], takes the weighted mean;
  4. shuffles with the policy's seeded RNG, then stable-sorts by score (so
     ties are broken at random but reproducibly);
  5. asks the picker.

Built-in policies (`scheduler.policy`):
  round_robin            smooth weighted round-robin over eligible engines
  least_load             weighted least-connections plus KV headroom
  prefix_approx          prefix affinity from where this policy sent each
                         prefix (no engine KV events), then load
  kv_precise             prefix affinity from engines' KV events, then load
  sticky_until_saturated the engine with the longest cached prefix
                         unless its estimated queueing exceeds the best other
                         engine's by scheduler.sticky_margin_seconds
                         (counting the prefill a colder engine would pay);
                         then, and for cold prefixes, least load, then the
                         fewest cached blocks (prefixes spread over engines)
  predicted_ttft         (default) the engine with the lowest predicted time to first
                         token from engines' measured speeds, counting
                         prefixes placed but not yet reported as cached;
                         a hot prefix spreads and shrinks back
                         (placement/predicted.py, placement/inflight.py);
                         a cold prefill (or a spread) is also charged the
                         re-prefill of the live blocks -- placed there in the
                         last seconds -- it would evict (placement/live.py)
  predicted_ttft_plain   predicted_ttft without that eviction charge
"""

from __future__ import annotations

import random
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence, Set
from dataclasses import dataclass
from typing import Literal, Protocol

from services.common.config import ConfigError, PolicyProfileConfig, SchedulerConfig

from .candidates import CandidatePlan, plan_for
from .completion import complete
from .inflight import InflightPrefixes, OverlaidPrefixes
from .interfaces import (
    EngineView,
    Filter,
    Picker,
    PickerState,
    PlacementRequest,
    ScoredEngine,
    Scorer,
)
from .live import LIVE_WINDOW_SECONDS, LiveWorkingSet
from .registry import PluginRegistry

__all__ = [
    "ApproxPrefixMemory",
    "BlockHolders",
    "Placement",
    "PlacementPolicy",
    "PrefixSource",
    "build_policy",
    "builtin_profiles",
]

_DEFAULT_FILTERS = [
    "model", "serving", "fresh", "not_draining", "not_excluded",
    "fits_context", "has_room", "lease_slots",
]


def builtin_profiles() -> dict[str, PolicyProfileConfig]:
    """The built-in policies as profiles (a fresh copy each call)."""

    def profile(
        scorers: dict[str, float], picker: str, source: Literal["kv_index", "kv_inflight", "approx", "none"]
    ) -> PolicyProfileConfig:
        return PolicyProfileConfig(
            filters=list(_DEFAULT_FILTERS), scorers=scorers, picker=picker,
            prefix_source=source,
        )

    return {
        "round_robin": profile({}, "round_robin", "none"),
        "least_load": profile({"load": 1.0, "kv_usage": 0.5}, "max_score", "none"),
        "prefix_approx": profile(
            {"prefix": 2.0, "load": 1.0, "kv_usage": 0.5}, "max_score", "approx"
        ),
        "kv_precise": profile(
            {"prefix": 2.0, "load": 1.0, "kv_usage": 0.5}, "max_score", "kv_index"
        ),
        "sticky_until_saturated": profile(
            {"load": 1.0, "kv_usage": 0.5, "cache_spread": 0.5}, "sticky_until_saturated", "kv_index"
        ),
        "predicted_ttft": profile(
            {"load": 1.0, "kv_usage": 0.5, "cache_spread": 0.5}, "predicted_ttft", "kv_inflight"
        ),
        "predicted_ttft_plain": profile(
            {"load": 1.0, "kv_usage": 0.5, "cache_spread": 0.5}, "predicted_ttft_plain", "kv_inflight"
        ),
    }


class PrefixSource(Protocol):
    def prefix_matches(self, prefix: Sequence[int], engines: Iterable[str]) -> dict[str, int]:
        """Per engine, how many leading hashes of `prefix` it holds."""


class BlockHolders(Protocol):
    def holders(self, block_hash: int) -> Set[str]:
        """The engines holding `block_hash` (the warm candidates, placement/candidates.py)."""


class _NoPrefix:
    def prefix_matches(self, prefix: Sequence[int], engines: Iterable[str]) -> dict[str, int]:
        return dict.fromkeys(engines, 0)


def _no_holders(block_hash: int) -> Set[str]:
    return frozenset()


class ApproxPrefixMemory:
    """Where this policy sent each prefix hash (LRU, bounded): an estimate of
    engines' caches for routers that do not see KV events."""

    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self._sent: OrderedDict[int, set[str]] = OrderedDict()

    def remember(self, prefix: Sequence[int], engine_id: str) -> None:
        for h in prefix:
            engines = self._sent.get(h)
            if engines is None:
                engines = self._sent[h] = set()
            else:
                self._sent.move_to_end(h)
            engines.add(engine_id)
        while len(self._sent) > self._capacity:
            self._sent.popitem(last=False)

    def forget_engine(self, engine_id: str) -> None:
        for engines in self._sent.values():
            engines.discard(engine_id)

    def holders(self, block_hash: int) -> Set[str]:
        return self._sent.get(block_hash, frozenset())

    def prefix_matches(self, prefix: Sequence[int], engines: Iterable[str]) -> dict[str, int]:
        result = dict.fromkeys(engines, 0)
        candidates = set(result)
        for i, h in enumerate(prefix):
            candidates &= self._sent.get(h, set())
            if not candidates:
                break
            for e in candidates:
                result[e] = i + 1
        return result


def _score_of(scored: ScoredEngine) -> float:
    return scored.score


@dataclass(frozen=True)
class PrefixMemoryLimits:
    """Bounds of a policy's own prefix memory (approx / kv_inflight)."""

    capacity: int                   # hashes remembered at most
    inflight_seconds: float = 5.0   # how long a placed prefix counts as cached
    # What ages them: the scheduler core's monotonic clock (`build_policy`),
    # so a fake clock ages them as it does leases and reports.
    clock: Callable[[], float] = time.monotonic


@dataclass(frozen=True)
class Placement:
    view: EngineView
    cached_tokens: int
    blocks_needed: int
    # The candidates the picker chose from, scored, best first (the same
    # list: kept for the request's trace, never copied).
    scored: Sequence[ScoredEngine] = ()


class PlacementPolicy:
    def __init__(
        self,
        name: str,
        filters: Sequence[Filter],
        scorers: Sequence[tuple[Scorer, float]],
        picker: Picker,
        prefix_source: str,
        seed: int,
        memory: PrefixMemoryLimits,
    ) -> None:
        self.name = name
        self.filters = list(filters)
        self.scorers = list(scorers)
        self.picker = picker
        self.prefix_source_name = prefix_source
        self.state = PickerState(rng=random.Random(seed))
        self.approx = ApproxPrefixMemory(memory.capacity) if prefix_source == "approx" else None
        self.inflight = (InflightPrefixes(memory.inflight_seconds, memory.capacity, memory.clock)
                         if prefix_source == "kv_inflight" else None)
        # Only for a picker that reads EngineView.live_blocks (placement/live.py).
        self.live = (LiveWorkingSet(LIVE_WINDOW_SECONDS, memory.capacity, memory.clock)
                     if getattr(picker, "uses_live_set", False) else None)
        # Which engines a decision scores (placement/candidates.py); None = all.
        self.plan: CandidatePlan | None = None

    def use_candidates(self, k: int) -> PlacementPolicy:
        """Score the candidates of `k` per figure (scheduler.placement_candidates;
        0 = every engine) when the fleet places through its indexes."""
        self.plan = plan_for([s.name for s, _ in self.scorers], self.picker.name,
                             [f.name for f in self.filters], k)
        return self

    def _prefix_source(self, kv_index: PrefixSource) -> PrefixSource:
        if self.prefix_source_name == "kv_index":
            return kv_index
        if self.inflight is not None:
            return OverlaidPrefixes(kv_index, self.inflight)
        if self.approx is not None:
            return self.approx
        return _NoPrefix()

    def prefix_holders(self, kv_index: BlockHolders) -> Callable[[int], Set[str]]:
        """Who holds a block, by this policy's prefix source (`_prefix_source`):
        the warm candidates (placement/candidates.py)."""
        inflight = self.inflight
        if self.prefix_source_name == "kv_index":
            return kv_index.holders
        if inflight is not None:
            def overlaid(block_hash: int) -> Set[str]:
                placed, reported = inflight.holders(block_hash), kv_index.holders(block_hash)
                return reported | placed if placed else reported
            return overlaid
        if self.approx is not None:
            return self.approx.holders
        return _no_holders

    def complete_views(
        self,
        request: PlacementRequest,
        engines: Sequence[EngineView],
        kv_index: PrefixSource,
        hash_block_tokens: int,
        headroom_tokens: int,
    ) -> list[EngineView]:
        """Fill in the request-dependent fields of each view."""
        matches = self._prefix_source(kv_index).prefix_matches(
            request.prefix_hashes, [e.engine_id for e in engines]
        )
        live = self.live.live_hashes(list(matches)) if self.live is not None else None
        return complete(request, engines, matches, live, hash_block_tokens, headroom_tokens)

    def score(self, request: PlacementRequest, views: Sequence[EngineView]) -> list[ScoredEngine]:
        """Weighted mean of clamped scores, ties shuffled, best first."""
        ids = [v.engine_id for v in views]
        totals = [0.0] * len(views)
        weight_sum = sum(w for _, w in self.scorers)
        if views and weight_sum > 0:
            for scorer, weight in self.scorers:
                get = scorer.score(request, views).get
                # In the engines' order, so each total adds its terms in scorer order as before.
                # Each value clamped to [0, 1], NaN -> 0 (it fails both tests); written
                # out, not called: it runs per scorer per candidate.
                totals = [total + weight * (v if 0.0 <= (v := float(get(engine_id, 0.0))) <= 1.0
                                            else 1.0 if v > 1.0 else 0.0)
                          for total, engine_id in zip(totals, ids, strict=True)]
            totals = [total / weight_sum for total in totals]
        scored = [ScoredEngine(v, total) for v, total in zip(views, totals, strict=True)]
        self.state.rng.shuffle(scored)
        scored.sort(key=_score_of, reverse=True)   # stable: ties keep the shuffled order
        return scored

    def place(
        self,
        request: PlacementRequest,
        engines: Sequence[EngineView],
        kv_index: PrefixSource,
        hash_block_tokens: int,
        headroom_tokens: int,
        remember: bool = True,
    ) -> Placement | None:
        """One engine for `request`, or None when no engine passes now.
        `remember=False`: a trial placement, maybe not taken (the caller
        calls `remember` for the one it takes; scheduler/batch_yield.py)."""
        views = self.complete_views(request, engines, kv_index, hash_block_tokens, headroom_tokens)
        if not request.reserved_slots:  # whatever the profile's filters: never a P0-reserved slot
            views = [v for v in views if v.unreserved_room()]
        for f in self.filters:
            if not views:
                return None
            views = f.filter(request, views)
        if not views:
            return None
        scored = self.score(request, views)
        chosen = self.picker.pick(request, scored, self.state)
        if chosen is None:
            return None
        if remember:
            self.remember(request, chosen.engine_id)
        return Placement(chosen, chosen.cached_tokens, chosen.blocks_needed, scored)

    def remember(self, request: PlacementRequest, engine_id: str) -> None:
        """The request went to `engine_id` (the approximate prefix memory)."""
        self.remember_prefix(request.prefix_hashes, engine_id)

    def remember_prefix(self, prefix: Sequence[int], engine_id: str) -> None:
        """A prompt with `prefix` went to `engine_id`: placed here, or by
        another scheduler replica (LoadReport.placed_elsewhere) -- each
        replica's in-flight prefixes and live set then cover every replica's
        placements, as one scheduler's would."""
        if not prefix:
            return
        if self.approx is not None:
            self.approx.remember(prefix, engine_id)
        if self.inflight is not None:
            self.inflight.add(prefix, engine_id)
        if self.live is not None:
            self.live.add(prefix, engine_id)

    def passes(self, request: PlacementRequest, view: EngineView) -> bool:
        """Whether one completed view passes every filter (no pick, no
        memory): preemption's test that a victim's slot makes room."""
        if not request.reserved_slots and not view.unreserved_room():
            return False
        views = [view]
        for f in self.filters:
            views = f.filter(request, views)
            if not views:
                return False
        return True

    def forget_engine(self, engine_id: str) -> None:
        self.state.rr_current.pop(engine_id, None)
        if self.approx is not None:
            self.approx.forget_engine(engine_id)
        if self.inflight is not None:
            self.inflight.forget_engine(engine_id)
        if self.live is not None:
            self.live.forget_engine(engine_id)


def build_policy(
    name: str, config: SchedulerConfig, registry: PluginRegistry, clock: Callable[[], float] = time.monotonic,
) -> PlacementPolicy:
    """The policy called `name`: config.policy_profiles first, then built-ins.
    `clock`: the scheduler core's monotonic clock, which times the policy's
    in-flight and live prefix memories."""
    profiles = builtin_profiles()
    profiles.update(config.policy_profiles)
    profile = profiles.get(name)
    if profile is None:
        raise ConfigError(f"scheduler.policy: unknown policy {name!r}; known: {sorted(profiles)}")
    where = f"scheduler.policy_profiles.{name}"
    policy = PlacementPolicy(
        name=name,
        filters=[registry.make_filter(f, f"{where}.filters") for f in profile.filters],
        scorers=[(registry.make_scorer(s, f"{where}.scorers"), w) for s, w in profile.scorers.items()],
        picker=registry.make_picker(profile.picker, f"{where}.picker"),
        prefix_source=profile.prefix_source,
        seed=config.placement_seed,
        memory=PrefixMemoryLimits(config.approx_prefix_capacity, config.inflight_prefix_seconds, clock),
    )
    return policy.use_candidates(config.placement_candidates)
