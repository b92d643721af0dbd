"""The `predicted_ttft` picker: each engine rated by the time to first token
this request would see there, from what the engine measures and reports.

    TTFT(e) = slot wait                     (no batch slot free: leases over max_running)
            + (tokens ahead + uncached) / prefill speed
            + steps x step time

* tokens ahead: the engine's queued prompt tokens (its report) plus the
  uncached prompt tokens of our leases it has not reported yet;
* uncached: the part of THIS prompt the engine does not hold (KV index plus
  the in-flight overlay, placement/inflight.py);
* prefill speed and step time: measured by the engine (LoadReport 310-312,
  services/engine/step_speed.py); step time includes the decode load of the
  batch running at the report, since every running sequence slows every
  step (the sim's cost model, sim/cost_model.py). The benchmark's sim
  prefills ~4,700 tok/s at speed_factor 4, so the fixed 20,000 made a cold
  prefill look 4x cheaper than it is and the sticky policy spilled too
  readily. An engine that has not measured yet borrows its peers' figures
  (`with_peer_speed`): one just (re)started, priced at the fixed 20,000 tok/s
  with no step term, looked several times faster than its measured peers and
  took a whole burst -- and kept it on the next turns, its prefixes now warm
  (seen: six streams after an engine's restart all on it, the other idle).
  With nobody measured: scheduler.prefill_tokens_per_second x weight and no
  step term;
* steps: 1 + tokens / the engine's step token budget (chunked prefill).

Choice, with `margin` seconds of hysteresis both ways:
1. No engine holds any of the prefix: the lowest predicted TTFT; engines
   within `_TIE_SECONDS` of it are equal and the scorers' order decides
   (load, KV headroom, fewest cached contexts).
2. Warm engines (holding part of the prefix) win unless the best of them is
   predicted worse than the best cold engine, its full prefill counted, by
   more than `margin`: then the hot prefix spreads to that cold engine (the
   overlay makes it warm for the rest of the burst, so one engine takes the
   copy, not several).
3. Among warm engines within `margin` of the best warm one: the longest
   prefix, then a stable per-prefix order (highest random weight of (prefix,
   engine), i.e. rendezvous hashing). The same engine therefore takes the
   prefix whenever it can, and an extra copy gets only the overflow.

`predicted_ttft` (evict_weight 1; `predicted_ttft_plain` has 0) orders cold engines by predicted
TTFT plus evict_weight x the prefill of the LIVE blocks the request's new
blocks would push out there: blocks over the engine's room (blocks_total -
live_blocks), live ones (placed there in the last few seconds,
placement/live.py) being what a session comes back to on its next turn. The
spread test (2.) compares the warm engines with these charged cold costs: a
hot prefix or a session's later turn leaves the engine holding it only when
that pays for the contexts the move evicts too.

Why this does not thrash: a copy is added only when the warm engines are
`margin` worse than a cold one even after paying its prefill; once added, a
copy takes requests only while the preferred warm engine is `margin` behind
it, and when load falls every request returns to the preferred engine (the
choice is a function of the load, not of the last pick), so the extra copy
stops being touched and ages out of its engine's LRU cache when other
contexts need the room. Nothing is evicted on purpose and nothing flips on
noise smaller than the margin.
"""

from __future__ import annotations

import dataclasses
import statistics
import zlib
from collections.abc import Sequence

from .interfaces import EngineView, PickerState, PlacementRequest, ScoredEngine

__all__ = ["PredictedTtftPicker", "eviction_seconds", "predicted_ttft", "with_peer_speed"]

# Idle engines' measured step speeds differ by timer noise (a few ms per
# step on the shared cores); closer than this, predictions are equal.
_TIE_SECONDS = 0.02


def _prefill_rate(view: EngineView, fallback_tokens_per_second: float) -> float:
    """The engine's measured prefill speed, else the fixed one x its weight."""
    return view.prefill_tokens_per_second or fallback_tokens_per_second * _weight(view)


def _weight(view: EngineView) -> float:
    """max(view.weight, 1e-9), written out: it runs several times per
    candidate per decision (a NaN weight stays NaN, as max keeps it)."""
    weight = view.weight
    return 1e-9 if weight < 1e-9 else weight


def predicted_ttft(request: PlacementRequest, view: EngineView, fallback_tokens_per_second: float) -> float:
    """Seconds until `request`'s first token on `view`'s engine."""
    fixed_rate = fallback_tokens_per_second * _weight(view)
    rate = view.prefill_tokens_per_second or fixed_rate          # _prefill_rate
    # The fleet's queue_seconds = queued_tokens at the fixed rate + slot wait
    # (fleet.py `_view`; for a P0 the slots batch lines leave it): the slot wait is the rest.
    slot_wait = view.queue_seconds - view.queued_tokens / fixed_rate
    slot_wait = slot_wait if slot_wait > 0.0 else 0.0           # max(0.0, ...), NaN -> 0.0 as there
    uncached = request.prompt_tokens - view.cached_tokens
    tokens = view.queued_tokens + view.unreported_tokens + (uncached if uncached > 0 else 0)
    steps = 1 + (tokens // view.step_token_budget if view.step_token_budget > 0 else 0)
    return slot_wait + tokens / rate + steps * view.step_seconds


def eviction_seconds(view: EngineView, fallback_tokens_per_second: float) -> float:
    """Prefill seconds of the live blocks `view`'s engine would evict to take
    the request's new blocks (0 while they fit beside its live set)."""
    if view.blocks_total <= 0:
        return 0.0
    live = view.live_blocks
    over = live + view.blocks_needed - view.blocks_total
    evicted = live if over > live else (over if over > 0 else 0)   # min(max(0, over), live)
    return evicted * view.block_size / _prefill_rate(view, fallback_tokens_per_second)


def with_peer_speed(views: Sequence[EngineView]) -> list[EngineView]:
    """`views` with an unmeasured prefill speed or step time taken from the
    measured ones, per unit of weight: the median prefill speed (engines of
    one model run alike) and the fastest step (an engine with nothing
    measured yet holds no batch, so its steps cost no more than the least
    loaded peer's). Unchanged when every candidate has measured both, the
    steady state (no work on this per-placement path), or none has."""
    if all(v.prefill_tokens_per_second > 0 and v.step_seconds > 0 for v in views):
        return list(views)
    rates = [v.prefill_tokens_per_second / max(v.weight, 1e-9) for v in views if v.prefill_tokens_per_second > 0]
    steps = [v.step_seconds * max(v.weight, 1e-9) for v in views if v.step_seconds > 0]
    if not rates and not steps:
        return list(views)
    rate = statistics.median(rates) if rates else 0.0
    step = min(steps) if steps else 0.0
    out: list[EngineView] = []
    for v in views:
        weight = max(v.weight, 1e-9)
        own_rate = v.prefill_tokens_per_second if v.prefill_tokens_per_second > 0 else rate * weight
        own_step = v.step_seconds if v.step_seconds > 0 else step / weight
        same = (own_rate, own_step) == (v.prefill_tokens_per_second, v.step_seconds)
        out.append(v if same else dataclasses.replace(v, prefill_tokens_per_second=own_rate, step_seconds=own_step))
    return out


_RANKS_KEPT = 4096


def _rank(request: PlacementRequest, engine_id: str) -> int:
    """Rendezvous weight of (the request's first prefix block, engine)."""
    root = request.prefix_hashes[0] if request.prefix_hashes else 0
    return zlib.crc32(f"{root}:{engine_id}".encode())


class PredictedTtftPicker:
    name = "predicted_ttft"

    def __init__(
        self, fallback_tokens_per_second: float, margin_seconds: float, evict_weight: float = 0.0,
        name: str = "predicted_ttft",
    ) -> None:
        if fallback_tokens_per_second <= 0:
            raise ValueError("prefill_tokens_per_second must be > 0")
        if margin_seconds < 0 or evict_weight < 0:
            raise ValueError("predicted_ttft margin and eviction weight must be >= 0")
        self.fallback = fallback_tokens_per_second
        self.margin = margin_seconds
        self.evict_weight = evict_weight
        # The policy tracks live working sets only for a picker that reads them.
        self.uses_live_set = evict_weight > 0
        self.name = name
        # Rendezvous weights (`_rank`) by prefix root, then engine: a hot
        # context's ~30 warm engines are ranked at each of its placements.
        # Bounded: cleared past _RANKS_KEPT roots.
        self._ranks: dict[int, dict[str, int]] = {}

    def pick(
        self, request: PlacementRequest, candidates: Sequence[ScoredEngine], state: PickerState
    ) -> EngineView | None:
        if not candidates:
            return None
        # Predicted on borrowed speeds, but what is returned is the engine's own view.
        own = {c.view.engine_id: c.view for c in candidates}
        views = with_peer_speed([c.view for c in candidates])
        predicted = [(v, predicted_ttft(request, v, self.fallback)) for v in views]
        warm = [(v, t) for v, t in predicted if v.prefix_blocks > 0]
        cold = [(v, t) for v, t in predicted if v.prefix_blocks <= 0]
        if self.evict_weight > 0:  # a cold choice, or a spread, pays for the live blocks it evicts
            cold = [(v, t + self.evict_weight * eviction_seconds(v, self.fallback)) for v, t in cold]
        best_cold = min((t for _, t in cold), default=float("inf"))
        if warm:
            best_warm = min(t for _, t in warm)
            if best_warm <= best_cold + self.margin:
                near = [v for v, t in warm if t <= best_warm + self.margin]
                ranks = self._ranks_of(request)

                def order(v: EngineView) -> tuple[int, int]:
                    rank = ranks.get(v.engine_id)
                    if rank is None:
                        rank = ranks[v.engine_id] = _rank(request, v.engine_id)
                    return v.prefix_blocks, rank

                return own[max(near, key=order).engine_id]
        # candidates are in score order: the first near-best cold engine
        return own[next(v for v, t in cold if t <= best_cold + _TIE_SECONDS).engine_id]

    def _ranks_of(self, request: PlacementRequest) -> dict[str, int]:
        """The memo of `_rank` for the request's prefix root."""
        root = request.prefix_hashes[0] if request.prefix_hashes else 0
        ranks = self._ranks.get(root)
        if ranks is None:
            if len(self._ranks) >= _RANKS_KEPT:
                self._ranks.clear()
            ranks = self._ranks[root] = {}
        return ranks
