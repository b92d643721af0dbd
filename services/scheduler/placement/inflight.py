"""Prefixes about to be cached: an overlay over the KV index (prefix source
`kv_inflight`) for requests placed but not yet reported by KV events.

An engine reports a prompt's blocks only once it has prefilled them: one
report interval plus queueing plus the prefill itself (~0.6 s for a
2,000-token context on the benchmark's sim at speed_factor 4). Until then the
KV index says nobody holds a new prefix, so a burst of requests sharing it is
placed as if cold, one by one: each on the least loaded engine, several
engines each paying the full prefill (and evicting other contexts for the
copy). With the overlay the first placement makes its engine warm for the
rest of the burst.

An entry lives until the first of:
* the KV index shows the engine holding the block (reported: the overlay is
  no longer needed, and the index then also sees its eviction);
* `ttl_seconds` after the placement (default 5 s, well past a cold prefill
  plus a report interval, yet short): the overlay cannot see a lease end or
  an abort before the prefill, and a wrong "warm" costs at most one
  misplaced prefill per prefix within that bound;
* the engine leaving (`forget_engine`) or the capacity bound (oldest first).

Owned by one `PlacementPolicy`; called on the scheduler core's thread only.
"""

from __future__ import annotations

import functools
import itertools
import math
import operator
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence, Set
from typing import Protocol

__all__ = ["InflightPrefixes", "OverlaidPrefixes"]

_NONE: dict[str, float] = {}   # read only: no engine placed the hash


class _Source(Protocol):
    def prefix_matches(self, prefix: Sequence[int], engines: Iterable[str]) -> dict[str, int]: ...


class InflightPrefixes:
    def __init__(self, ttl_seconds: float, capacity: int, clock: Callable[[], float] = time.monotonic) -> None:
        if ttl_seconds <= 0 or capacity <= 0:
            raise ValueError("in-flight prefix TTL and capacity must be > 0")
        self._ttl = ttl_seconds
        self._capacity = capacity
        self._clock = clock
        # hash -> engine id -> expiry; in order of last placement, so the
        # oldest (first to expire, TTLs being equal) are at the front.
        self._entries: OrderedDict[int, dict[str, float]] = OrderedDict()
        # Drops `extend` decided, not yet done: (engine, prefix, reported
        # length). Done before anything reads the entries (`_settle`) -- but
        # one the request's own placement makes moot is skipped: `add` then
        # stamps that engine on every hash of the prefix anyway (a warm
        # engine's whole context, ~125 hashes, at each placement there).
        self._pending: list[tuple[str, Sequence[int], int]] = []

    def __len__(self) -> int:
        return len(self._entries)

    def _settle(self, moot: tuple[str, Sequence[int]] | None = None) -> None:
        """Do the pending drops but those of `moot` (engine, the prefix `add` stamps it on)."""
        for engine_id, prefix, held in self._pending:
            if moot is None or engine_id != moot[0] or prefix is not moot[1]:
                self._drop(engine_id, prefix[:held])
        self._pending.clear()

    def add(self, prefix: Sequence[int], engine_id: str) -> None:
        """`engine_id` is about to cache `prefix` (a request was placed there)."""
        self._settle((engine_id, prefix))
        now = self._clock()
        expires = now + self._ttl
        for h in prefix:
            engines = self._entries.get(h)
            if engines is None:
                engines = self._entries[h] = {}
            else:
                self._entries.move_to_end(h)
            engines[engine_id] = expires
        while self._entries:
            first = next(iter(self._entries.values()))
            if len(self._entries) <= self._capacity and max(first.values(), default=float("-inf")) >= now:
                break
            self._entries.popitem(last=False)

    def forget_engine(self, engine_id: str) -> None:
        self._settle()
        for engines in self._entries.values():
            engines.pop(engine_id, None)

    def _holds(self, engine_id: str, block_hash: int, now: float) -> bool:
        engines = self._entries.get(block_hash)
        expires = engines.get(engine_id) if engines is not None else None
        return expires is not None and expires >= now

    def holders(self, block_hash: int) -> Set[str]:
        """The engines `block_hash` was placed on within the TTL."""
        self._settle()
        engines = self._entries.get(block_hash)
        if not engines:
            return frozenset()
        now = self._clock()
        return {e for e, expires in engines.items() if expires >= now}

    def extend(self, prefix: Sequence[int], reported: dict[str, int]) -> dict[str, int]:
        """Per engine, its reported match extended by the hashes placed there
        since; entries the report already covers are dropped."""
        if not self._entries or not prefix:
            return reported
        self._settle()
        now = self._clock()
        result = dict(reported)
        first = self._entries.get(prefix[0], _NONE)    # who was placed the prompt's first block
        for engine_id, held in reported.items():
            if not held and engine_id not in first:
                continue    # most candidates: nothing reported, nothing placed (kept at 0)
            if held and self._holds(engine_id, prefix[held - 1], now):
                self._pending.append((engine_id, prefix, held))  # reported: no longer in flight
            result[engine_id] = held + self._run(engine_id, prefix, held, now)
        return result

    def _drop(self, engine_id: str, hashes: Sequence[int]) -> None:
        """Forget `engine_id`'s entries of `hashes`, in one C-level pass (a
        warm engine's whole context, ~125 hashes, at every placement there)."""
        placed = filter(None, map(self._entries.get, hashes))
        deque(map(dict.pop, placed, itertools.repeat(engine_id), itertools.repeat(None)), maxlen=0)

    def _run(self, engine_id: str, prefix: Sequence[int], start: int, now: float) -> int:
        """How many hashes of `prefix` from `start` on `engine_id` holds in
        the overlay (`_holds` each, in C: a copy placed on a cold engine is
        walked at every placement of its prefix)."""
        if start >= len(prefix) or not self._holds(engine_id, prefix[start], now):
            return 0    # the usual answer (an engine nothing was placed on): no iterators built
        placed = map(self._entries.get, itertools.islice(prefix, start, None), itertools.repeat(_NONE))
        expiries = map(dict.get, placed, itertools.repeat(engine_id), itertools.repeat(-math.inf))
        return len(list(itertools.takewhile(functools.partial(operator.le, now), expiries)))


class OverlaidPrefixes:
    """A prefix source: the KV index's matches extended by the overlay."""

    def __init__(self, base: _Source, inflight: InflightPrefixes) -> None:
        self._base = base
        self._inflight = inflight

    def prefix_matches(self, prefix: Sequence[int], engines: Iterable[str]) -> dict[str, int]:
        return self._inflight.extend(prefix, self._base.prefix_matches(prefix, engines))
