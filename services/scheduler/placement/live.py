"""Each engine's LIVE working set: the prefix blocks of requests this policy
placed there within the last `window_seconds` -- contexts a session is about
to come back to. A cold prefill that overflows an engine's free room evicts
cached blocks (LRU); if those are live, the session that owns them pays a
cold prefill of them on its next turn. The predicted_ttft picker
(placement/predicted.py) charges that cost to each cold choice.

Why a window of 4 s: on the cache_pressure workload (services/bench/
workloads.py) a session's next turn is placed one think time (1 s) after its
turn ends, and a turn lasts its TTFT (p90 ~0.9 s under pressure) plus 32
decoded tokens (~0.5-1 s at speed 4): ~3 s between a session's placements,
so 4 s covers a session mid-conversation and lets a finished one (or a
group context nobody resumed) age out within about one turn.

Counted in hashes (hash_block_tokens each); the policy converts to the
engine's blocks. Bounded: at most `capacity` (engine, hash) entries, oldest
dropped first. Owned by one PlacementPolicy; core thread only.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

__all__ = ["LIVE_WINDOW_SECONDS", "LiveWorkingSet"]

LIVE_WINDOW_SECONDS = 4.0


class LiveWorkingSet:
    def __init__(
        self, window_seconds: float, capacity: int, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if window_seconds <= 0 or capacity <= 0:
            raise ValueError("live working set window and capacity must be > 0")
        self._window = window_seconds
        self._capacity = capacity
        self._clock = clock
        # engine id -> hash -> last placement time, oldest first
        self._engines: dict[str, OrderedDict[int, float]] = {}
        self._size = 0

    def add(self, prefix: Sequence[int], engine_id: str) -> None:
        """A request with `prefix` was placed on `engine_id` now."""
        now = self._clock()
        entries = self._engines.setdefault(engine_id, OrderedDict())
        for h in prefix:
            if h in entries:
                entries.move_to_end(h)
            else:
                self._size += 1
            entries[h] = now
        self._expire(now)
        while self._size > self._capacity:  # drop the globally oldest entry
            oldest = min((e for e in self._engines.values() if e), key=lambda e: next(iter(e.values())))
            oldest.popitem(last=False)
            self._size -= 1

    def _expire(self, now: float) -> None:
        horizon = now - self._window
        for entries in self._engines.values():
            while entries and next(iter(entries.values())) < horizon:
                entries.popitem(last=False)
                self._size -= 1

    def live_hashes(self, engine_ids: Sequence[str]) -> dict[str, int]:
        """Per engine, the distinct prefix hashes placed there within the window."""
        self._expire(self._clock())
        return {e: len(self._engines.get(e, ())) for e in engine_ids}

    def forget_engine(self, engine_id: str) -> None:
        entries = self._engines.pop(engine_id, None)
        if entries:
            self._size -= len(entries)
