"""Which engine's prefix cache holds which block hash, from engines' KV
events and snapshots.

Two maps kept in step: hash -> engines and engine -> hashes, so a lookup is
O(prefix length x engines) and dropping an engine is O(its blocks); and a
third, hash -> the bit mask of its holders (each engine a bit), so the
prefix walk of many warm engines is one running AND per hash, in C. The
per-engine sequence check lives here too: a KvEvents message must carry the
previous seq + 1, otherwise the view is unreliable and the engine is asked
for a snapshot (the caller sends Resync). Owned by `EngineFleet` (fleet.py).
"""

from __future__ import annotations

import itertools
import operator
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
        # hash -> OR of its holders' bits; engine -> its bit (freed bits reused).
        self._masks: dict[int, int] = {}
        self._bits: dict[str, int] = {}
        self._free_bits: list[int] = []

    def _bit_of(self, engine_id: str) -> int:
        bit = self._bits.get(engine_id)
        if bit is None:
            bit = self._bits[engine_id] = self._free_bits.pop() if self._free_bits else 1 << len(self._bits)
        return bit

    def blocks(self, engine_id: str) -> int:
        return len(self._held.get(engine_id, ()))

    def holds(self, engine_id: str, block_hash: int) -> bool:
        return block_hash in self._held.get(engine_id, ())

    def _add(self, engine_id: str, hashes: Iterable[int]) -> None:
        held = self._held.setdefault(engine_id, set())
        bit, masks = self._bit_of(engine_id), self._masks
        for h in hashes:
            if h not in held:
                held.add(h)
                self._holders.setdefault(h, set()).add(engine_id)
                masks[h] = masks.get(h, 0) | bit

    def _remove(self, engine_id: str, hashes: Iterable[int]) -> None:
        held = self._held.get(engine_id)
        if not held:
            return
        keep = ~self._bits[engine_id]
        for h in hashes:
            if h in held:
                held.discard(h)
                self._unhold(h, engine_id, keep)

    def _unhold(self, block_hash: int, engine_id: str, keep: int) -> None:
        """`engine_id` (all bits but its own: `keep`) no longer holds `block_hash`."""
        holders = self._holders[block_hash]
        holders.discard(engine_id)
        if holders:
            self._masks[block_hash] &= keep
        else:
            del self._holders[block_hash]
            del self._masks[block_hash]

    def drop_engine(self, engine_id: str) -> None:
        """Forget everything an engine held, at once."""
        held = self._held.pop(engine_id, set())
        bit = self._bits.pop(engine_id, 0)
        for h in held:
            self._unhold(h, engine_id, ~bit)
        if bit:
            self._free_bits.append(bit)
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
        engine holding the first block alone while they are few, else all
        of them at once by their holder bits (`_deep_matches`)."""
        alive = dict.fromkeys(engines, 0)
        candidates = alive.keys() & self._holders.get(prefix[0], _NOBODY) if prefix else set()
        if len(candidates) <= _FEW_ENGINES:
            for e in candidates:
                alive[e] = len(list(itertools.takewhile(self._held[e].__contains__, prefix)))
            return alive
        return self._deep_matches(prefix, candidates, alive)

    def _deep_matches(self, prefix: Sequence[int], engines: Set[str], alive: dict[str, int]) -> dict[str, int]:
        """`alive` with each of `engines` (all holding prefix[0]) given how
        many leading hashes of `prefix` it holds. The running AND of their
        bits with each hash's holder mask (`accumulate`, in C) only loses
        bits as it goes; `groupby` finds the few places it does, and whose
        bits went there: those engines' runs end just before."""
        bits = self._bits
        group = 0
        for e in engines:
            group |= bits[e]
        runs = itertools.accumulate(map(self._masks.get, prefix, itertools.repeat(0)), operator.and_, initial=group)
        start, before = 0, 0    # start: index of the group's first running AND (k = hashes ANDed in)
        for value, run in itertools.groupby(runs):
            if start:
                self._ended(engines, before & ~value, start - 1, alive)
            before = value
            if not value:
                return alive
            start += len(list(run))
        self._ended(engines, before, start - 1, alive)
        return alive

    def _ended(self, engines: Set[str], gone: int, depth: int, alive: dict[str, int]) -> None:
        bits = self._bits
        for e in engines:
            if bits[e] & gone:
                alive[e] = depth
