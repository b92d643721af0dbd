"""Block reservations: blocks a placement will need, counted against an
engine until its load report shows the request (then the blocks are in the
report's blocks_used) or the lease ends, so a burst of placements between two
reports cannot overfill one engine. Owned by `EngineFleet` (fleet.py).
"""

from __future__ import annotations

from collections.abc import Set

__all__ = ["ReservationBook", "blocks_needed"]


def blocks_needed(
    prompt_tokens: int, max_tokens: int, cached_tokens: int, block_size: int, headroom: int
) -> int:
    """Engine blocks a request will newly take: its prompt blocks not already
    cached plus decode room of min(max_tokens, headroom) tokens."""
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    total_tokens = prompt_tokens + min(max_tokens, headroom)
    total_blocks = -(-total_tokens // block_size)
    cached_blocks = min(cached_tokens, prompt_tokens) // block_size
    return max(0, total_blocks - cached_blocks)


class ReservationBook:
    """engine -> request -> reserved blocks, with per-engine totals."""

    def __init__(self) -> None:
        self._by_engine: dict[str, dict[str, int]] = {}
        self._totals: dict[str, int] = {}

    def reserved(self, engine_id: str) -> int:
        return self._totals.get(engine_id, 0)

    def reserve(self, engine_id: str, request_id: str, blocks: int) -> None:
        if blocks < 0:
            raise ValueError("cannot reserve a negative number of blocks")
        book = self._by_engine.setdefault(engine_id, {})
        previous = book.get(request_id, 0)
        book[request_id] = blocks
        self._totals[engine_id] = self._totals.get(engine_id, 0) - previous + blocks

    def release(self, engine_id: str, request_id: str) -> int:
        """Drop one reservation (idempotent); returns the blocks freed."""
        book = self._by_engine.get(engine_id)
        if not book or request_id not in book:
            return 0
        blocks = book.pop(request_id)
        self._totals[engine_id] -= blocks
        return blocks

    def settle(self, engine_id: str, running_ids: Set[str]) -> int:
        """The engine reported these request ids: their blocks are now in its
        blocks_used, so their reservations end. Returns blocks settled."""
        book = self._by_engine.get(engine_id)
        if not book:
            return 0
        settled = [rid for rid in book if rid in running_ids]
        return sum(self.release(engine_id, rid) for rid in settled)

    def drop_engine(self, engine_id: str) -> None:
        self._by_engine.pop(engine_id, None)
        self._totals.pop(engine_id, None)

    def count(self, engine_id: str) -> int:
        return len(self._by_engine.get(engine_id, ()))
