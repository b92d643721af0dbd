"""The floor's prefix cache (services/bench/floor.py): unbounded, or the
fleet's KV pooled into one clairvoyant cache.

`UnboundedKv`: every computed block stays cached forever, fleet-wide (the
floor of the brief: "every prefix cached where it could be").

`PooledKv`: the fleet's whole KV (engines x total_blocks blocks) as one
cache shared by every engine, evicting by Belady's MIN -- the cached block
not pinned by a running request whose next use (the earliest request not yet
admitted whose prompt contains it) is farthest away. Why it bounds what a
router can get from this fleet's KV: any state of the real per-engine caches
(blocks duplicated on several engines, split by engine) is also a state of
the pooled cache with no more blocks, and for unit-size blocks Belady's MIN
has the fewest misses of any eviction order (Belady 1966; the sim's prefix
rule only ever needs a block together with its parents, whose next use is
never later, so MIN keeps chains whole). It is an approximation, not a proof,
in two places: MIN minimizes the total of misses, not each request's, so a
TTFT percentile could in principle come out a little lower under another
eviction order; and when running requests pin more than the KV holds the
pool overflows instead of preempting (the sim would preempt: optimistic).
"""

from __future__ import annotations

import heapq
import math
from collections import Counter
from collections.abc import Iterable, Sequence

__all__ = ["PooledKv", "UnboundedKv"]


class UnboundedKv:
    """Every block computed anywhere, cached everywhere, forever."""

    def __init__(self, warm: Iterable[int] = ()) -> None:
        self.cached = set(warm)

    def __contains__(self, block: int) -> bool:
        return block in self.cached

    def add(self, block: int, depth: int = 0) -> None:
        self.cached.add(block)

    def pin(self, blocks: Iterable[int]) -> None:
        pass

    def unpin(self, blocks: Iterable[int]) -> None:
        pass

    def admitted(self, index: int, blocks: Iterable[int]) -> None:
        pass

    def trim(self, private_blocks: int) -> None:
        pass


class PooledKv(UnboundedKv):
    """The fleet's KV as one cache of `capacity` blocks with Belady eviction.
    `uses[block]`: the indices, ascending in arrival order, of the requests
    whose prompt could hit that block."""

    def __init__(self, capacity: int, uses: dict[int, list[int]], warm: Sequence[tuple[int, int]] = ()) -> None:
        super().__init__()
        self.capacity = capacity
        self.uses = uses
        self.next_at: dict[int, int] = {}   # block -> position in uses[block] of its next user
        self.done: set[int] = set()          # requests admitted (no longer a future use)
        self.pins: Counter[int] = Counter()
        self.depth: dict[int, int] = {}      # block -> its place in its chain (0 = first)
        # (-next use, -depth, block): farthest next use first, then the deepest
        # block (a chain loses its tail, never a parent); stale entries skipped.
        self.heap: list[tuple[float, int, int]] = []
        for block, depth in warm:
            self.add(block, depth)
        self.trim(0)

    def next_use(self, block: int) -> float:
        users = self.uses.get(block, [])
        at = self.next_at.get(block, 0)
        while at < len(users) and users[at] in self.done:
            at += 1
        self.next_at[block] = at
        return users[at] if at < len(users) else math.inf

    def add(self, block: int, depth: int = 0) -> None:
        if block not in self.cached:
            self.cached.add(block)
            self.depth[block] = depth
            heapq.heappush(self.heap, (-self.next_use(block), -depth, block))

    def pin(self, blocks: Iterable[int]) -> None:
        self.pins.update(blocks)

    def unpin(self, blocks: Iterable[int]) -> None:
        self.pins.subtract(blocks)

    def admitted(self, index: int, blocks: Iterable[int]) -> None:
        """Request `index` took its blocks: their next use moves on."""
        self.done.add(index)
        for block in blocks:
            if block in self.cached:
                heapq.heappush(self.heap, (-self.next_use(block), -self.depth[block], block))

    def trim(self, private_blocks: int) -> None:
        """Evict until the cache plus running requests' private blocks fit."""
        held: list[tuple[float, int, int]] = []
        while self.heap and len(self.cached) + private_blocks > self.capacity:
            entry = heapq.heappop(self.heap)
            key, _, block = entry
            if block not in self.cached or -key != self.next_use(block):
                continue  # evicted, or a newer entry holds its current next use
            if self.pins[block] > 0:
                held.append(entry)
                continue
            self.cached.discard(block)
        for entry in held:
            heapq.heappush(self.heap, entry)
