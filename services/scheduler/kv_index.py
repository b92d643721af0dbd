"""Which engine's prefix cache holds which block hash, from engines' KV
events and snapshots.

Two maps kept in step: hash -> engines and engine -> hashes, so a lookup is
O(prefix length x engines) and dropping an engine is O(its blocks). The
per-engine sequence check lives here too: a KvEvents message must carry the
previous seq + 1, otherwise the view is unreliable and the engine is asked
for a snapshot (the caller sends Resync). Owned by `EngineFleet` (fleet.py).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence, Set
from dataclasses import dataclass

__all__ = ["KvIndex", "SeqCheck"]

_NOBODY: frozenset[str] = frozenset()
# Up to this many engines holding a prompt's first block, each walks its own
# held set (~70 ns a hash each); more share one walk (~250 ns a hash, +~10 an engine).
_FEW_ENGINES = 4


@dataclass
class SeqCheck:
    """Sequence state of one engine's KV stream."""

    expected: int | None = None    # seq the next KvEvents must carry
    resync_pending: bool = False


class KvIndex:
    def __init__(self) -> None:
        self._holders: dict[int, set[str]] = {}
        self._held: dict[str, set[int]] = {}
        self._seq: dict[str, SeqCheck] = {}

    def blocks(self, engine_id: str) -> int:
        return len(self._held.get(engine_id, ()))

    def holds(self, engine_id: str, block_hash: int) -> bool:
        return block_hash in self._held.get(engine_id, ())

    def _add(self, engine_id: str, hashes: Iterable[int]) -> None:
        held = self._held.setdefault(engine_id, set())
        for h in hashes:
            if h not in held:
                held.add(h)
                self._holders.setdefault(h, set()).add(engine_id)

    def _remove(self, engine_id: str, hashes: Iterable[int]) -> None:
        held = self._held.get(engine_id)
        if not held:
            return
        for h in hashes:
            if h in held:
                held.discard(h)
                holders = self._holders[h]
                holders.discard(engine_id)
                if not holders:
                    del self._holders[h]

    def drop_engine(self, engine_id: str) -> None:
        """Forget everything an engine held, at once."""
        held = self._held.pop(engine_id, set())
        for h in held:
            holders = self._holders[h]
            holders.discard(engine_id)
            if not holders:
                del self._holders[h]
        self._seq.pop(engine_id, None)

    def apply_snapshot(self, engine_id: str, seq: int, hashes: Sequence[int]) -> None:
        """Replace the engine's view; the next KvEvents must carry seq + 1."""
        held = self._held.get(engine_id, set())
        fresh = set(hashes)
        self._remove(engine_id, held - fresh)
        self._add(engine_id, fresh - held)
        self._seq[engine_id] = SeqCheck(expected=seq + 1)

    def apply_events(
        self,
        engine_id: str,
        seq: int,
        stored: Sequence[int],
        removed: Sequence[int],
        cleared: bool,
    ) -> bool:
        """Apply one KvEvents message. Returns True when the caller must send
        Resync (a gap, a repeat, or events before any snapshot); events are
        then ignored until the snapshot arrives."""
        check = self._seq.setdefault(engine_id, SeqCheck())
        if check.resync_pending:
            return False            # already asked; wait for the snapshot
        if check.expected is None or seq != check.expected:
            check.resync_pending = True
            return True
        check.expected = seq + 1
        if cleared:
            self._remove(engine_id, list(self._held.get(engine_id, ())))
        self._remove(engine_id, removed)
        self._add(engine_id, stored)
        return False

    def holders(self, block_hash: int) -> Set[str]:
        """The engines holding `block_hash` (read-only; empty if none)."""
        return self._holders.get(block_hash, frozenset())

    def resync_pending(self, engine_id: str) -> bool:
        check = self._seq.get(engine_id)
        return bool(check and check.resync_pending)

    def prefix_matches(self, prefix: Sequence[int], engines: Iterable[str]) -> dict[str, int]:
        """Per engine, how many leading hashes of `prefix` it holds (0 if none).
        Walked in C (a warm context is ~125 hashes at every placement): each
        engine holding the first block alone while they are few, else the
        stretches all remaining ones hold (`_common_run`), each engine
        written once, when it drops out."""
        alive = dict.fromkeys(engines, 0)
        candidates = alive.keys() & self._holders.get(prefix[0], _NOBODY) if prefix else set()
        if len(candidates) <= _FEW_ENGINES:
            for e in candidates:
                alive[e] = len(list(itertools.takewhile(self._held[e].__contains__, prefix)))
            return alive
        depth, n = 1, len(prefix)
        while candidates and depth < n:
            depth += self._common_run(prefix, depth, candidates)
            if depth >= n:
                break
            kept = candidates & self._holders.get(prefix[depth], _NOBODY)
            for e in candidates - kept:
                alive[e] = depth
            candidates = kept
            depth += 1 if kept else 0
        for e in candidates:
            alive[e] = depth
        return alive

    def _common_run(self, prefix: Sequence[int], start: int, engines: set[str]) -> int:
        """How many hashes of `prefix` from `start` on all of `engines` hold."""
        holders = map(self._holders.get, itertools.islice(prefix, start, None), itertools.repeat(_NOBODY))
        return len(list(itertools.takewhile(engines.issubset, holders)))
