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

import itertools
import operator
import time
from collections import deque
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
        # engine id -> hash -> stamp of the placement that last added it
        self._engines: dict[str, dict[int, int]] = {}
        self._size = 0
        # Every placement, oldest first: (time, stamp, engine, its hashes). Ageing
        # out and the capacity bound pop from its front, so neither scans the
        # engines (that was O(engines) twice per decision); an entry a later
        # placement refreshed carries that one's stamp and is left alone.
        self._placed: deque[tuple[float, int, str, Sequence[int]]] = deque()
        self._stamps = itertools.count()

    def add(self, prefix: Sequence[int], engine_id: str) -> None:
        """A request with `prefix` was placed on `engine_id` now."""
        now, stamp = self._clock(), next(self._stamps)
        entries = self._engines.get(engine_id)
        if entries is None:
            entries = self._engines[engine_id] = {}
        before = len(entries)
        # One C-level pass (a prefix is ~125 hashes, one placement per decision).
        entries.update(zip(prefix, itertools.repeat(stamp)))
        self._size += len(entries) - before
        self._placed.append((now, stamp, engine_id, prefix))
        self._expire(now)
        self._bound()

    def _bound(self) -> None:
        """Drop the oldest entries (placement order) while over capacity."""
        while self._size > self._capacity and self._placed:
            _, stamp, engine_id, hashes = self._placed[0]
            entries = self._engines.get(engine_id)
            for h in hashes:
                if self._size <= self._capacity:
                    return
                if entries is not None and entries.get(h) == stamp:
                    del entries[h]
                    self._size -= 1
            self._placed.popleft()

    def _expire(self, now: float) -> None:
        horizon = now - self._window
        placed = self._placed
        while placed and placed[0][0] < horizon:
            _, stamp, engine_id, hashes = placed.popleft()
            entries = self._engines.get(engine_id)
            if entries:
                self._drop(entries, hashes, stamp)

    def _drop(self, entries: dict[int, int], hashes: Sequence[int], stamp: int) -> None:
        """Take out the `hashes` still carrying placement `stamp` (a later
        placement's are left). The test runs in C: most of a hot context's
        hashes were refreshed since."""
        mine = itertools.compress(hashes, map(operator.eq, map(entries.get, hashes), itertools.repeat(stamp)))
        for h in list(mine):
            if entries.pop(h, None) is not None:    # a hash twice in one prefix goes once
                self._size -= 1

    def live_hashes(self, engine_ids: Sequence[str]) -> dict[str, int]:
        """Per engine, the distinct prefix hashes placed there within the window."""
        self._expire(self._clock())
        return {e: len(self._engines.get(e, ())) for e in engine_ids}

    def forget_engine(self, engine_id: str) -> None:
        entries = self._engines.pop(engine_id, None)
        if entries:
            self._size -= len(entries)
