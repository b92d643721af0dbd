"""Built-in pickers: choose one engine from the scored candidates."""

from __future__ import annotations

from collections.abc import Sequence

from .interfaces import EngineView, PickerState, PlacementRequest, ScoredEngine

__all__ = ["MaxScorePicker", "RoundRobinPicker", "StickyUntilSaturatedPicker"]


class MaxScorePicker:
    """The best score; ties already in seeded random order."""

    name = "max_score"

    def pick(
        self, request: PlacementRequest, candidates: Sequence[ScoredEngine], state: PickerState
    ) -> EngineView | None:
        return candidates[0].view if candidates else None


class RoundRobinPicker:
    """Smooth weighted round-robin (nginx's): each pick adds every
    candidate's weight to its current value, takes the largest and subtracts
    the total. Equal weights cycle A, B, C, A...; weight 2 gets twice the turns,
    interleaved. Scores are ignored."""

    name = "round_robin"

    def pick(
        self, request: PlacementRequest, candidates: Sequence[ScoredEngine], state: PickerState
    ) -> EngineView | None:
        if not candidates:
            return None
        views = sorted((c.view for c in candidates), key=lambda v: v.engine_id)
        total = 0.0
        best: EngineView | None = None
        for view in views:
            current = state.rr_current.get(view.engine_id, 0.0) + view.weight
            state.rr_current[view.engine_id] = current
            total += view.weight
            if best is None or current > state.rr_current[best.engine_id]:
                best = view
        if best is None:
            return None
        state.rr_current[best.engine_id] -= total
        return best


class StickyUntilSaturatedPicker:
    """Prefix affinity until it costs more than it saves.

    Take the engine holding the longest cached prefix, unless its estimated
    time to start exceeds the best other engine's by more than
    `margin_seconds` (it is saturated: waiting there costs more than
    prefilling elsewhere); then the best-scored other engine; when no engine
    holds any of the prefix, the best-scored engine (the policy's scorers
    measure load).

    Time to start = estimated queueing + prefilling what the engine does not
    hold, at `prefill_tokens_per_second` x weight (0 = queueing only). Without
    the prefill term a warm engine with a short queue lost to a cold one that
    then spent a whole prefill on the request -- and evicted another group's
    context to hold it. In the routers-side-by-side benchmark (8 sim
    engines, 16 groups x 2,000-token contexts, cold start) adding the
    prefill term, with the sim's queued-token fix, took this policy's TTFT
    p90 from 588 ms to 277 ms (BENCHMARKS.md, "Routers side by side").
    """

    name = "sticky_until_saturated"

    def __init__(self, margin_seconds: float, prefill_tokens_per_second: float = 0.0) -> None:
        if margin_seconds < 0:
            raise ValueError("sticky margin must be >= 0 seconds")
        if prefill_tokens_per_second < 0:
            raise ValueError("prefill_tokens_per_second must be >= 0")
        self.margin_seconds = margin_seconds
        self.prefill_tokens_per_second = prefill_tokens_per_second

    def _start_seconds(self, request: PlacementRequest, view: EngineView) -> float:
        if self.prefill_tokens_per_second <= 0:
            return view.queue_seconds
        uncached = max(0, request.prompt_tokens - view.cached_tokens)
        return view.queue_seconds + uncached / (self.prefill_tokens_per_second * max(view.weight, 1e-9))

    def pick(
        self, request: PlacementRequest, candidates: Sequence[ScoredEngine], state: PickerState
    ) -> EngineView | None:
        if not candidates:
            return None
        best_prefix = max(c.view.prefix_blocks for c in candidates)
        if best_prefix <= 0:
            return candidates[0].view
        # Among engines with the longest prefix, the least queued (then score order).
        warm = min(
            (c for c in candidates if c.view.prefix_blocks == best_prefix),
            key=lambda c: c.view.queue_seconds,
        )
        others = [c for c in candidates if c.view.engine_id != warm.view.engine_id]
        if not others:
            return warm.view
        best_other = min(self._start_seconds(request, c.view) for c in others)
        if self._start_seconds(request, warm.view) - best_other <= self.margin_seconds:
            return warm.view
        return others[0].view           # saturated: the best-scored other engine
