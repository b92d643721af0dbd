"""Paged KV blocks with a prefix cache, as in vLLM's v1 KV-cache manager.

Each block holds `block_size` tokens. A block that a request has completely
filled gets a key -- the shared-space hash of its last hash-block, which
chains over every token before it -- and enters the prefix cache, so a later
request whose prompt starts with the same tokens reuses it instead of
prefilling it again.

* A block referenced by a running request is pinned (ref count > 0).
* Free blocks come in two kinds: never-filled ones (taken first) and cached
  ones, kept in LRU order and evicted -- oldest first -- only when no
  never-filled block is left. A request frees its blocks tail first, so a
  prefix's last blocks are evicted before its first ones.
* Allocation never exceeds `total_blocks`: it either succeeds in full or
  changes nothing.

Every change of the cache goes to a `KvListener` in the shared hash space: a
block covering k hash-blocks is stored/removed as its k hashes.

Ownership: one `BlockPool` belongs to one `SimCore`; all methods are
synchronous and called from the event loop thread only.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence

from services.engine.backend import KvListener

__all__ = ["BlockPool", "OutOfBlocks"]


class OutOfBlocks(RuntimeError):
    """An allocation was asked for more blocks than are free."""


class BlockPool:
    def __init__(self, total_blocks: int) -> None:
        if total_blocks <= 0:
            raise ValueError(f"total_blocks must be positive, got {total_blocks}")
        self.total_blocks = total_blocks
        self._refs = [0] * total_blocks
        self._key: list[int | None] = [None] * total_blocks
        self._hashes: dict[int, tuple[int, ...]] = {}   # block -> shared hashes it covers
        self._cached: dict[int, int] = {}               # key -> block
        self._free_plain: deque[int] = deque(range(total_blocks))
        self._free_cached: OrderedDict[int, None] = OrderedDict()  # LRU, oldest first
        self._listener: KvListener | None = None
        self.used = 0  # blocks with ref > 0

    # ---------------------------------------------------------------- views

    @property
    def free(self) -> int:
        """Blocks an allocation may take (never-filled plus evictable cached)."""
        return len(self._free_plain) + len(self._free_cached)

    @property
    def cached_blocks(self) -> int:
        return len(self._cached)

    def set_listener(self, listener: KvListener | None) -> None:
        self._listener = listener

    def snapshot(self) -> list[int]:
        """Every shared-space hash the cache holds, blocks in no special order."""
        return [h for block in self._cached.values() for h in self._hashes[block]]

    def lookup(self, keys: Sequence[int]) -> list[int]:
        """Blocks holding the longest cached run of `keys` (first key first)."""
        blocks: list[int] = []
        for key in keys:
            block = self._cached.get(key)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def evictable_among(self, blocks: Sequence[int]) -> int:
        """How many of `blocks` are free-but-cached (would stop being free once touched)."""
        return sum(1 for b in blocks if self._refs[b] == 0)

    # ---------------------------------------------------------------- changes

    def touch(self, blocks: Sequence[int]) -> None:
        """Take a reference on cached blocks (a prefix-cache hit)."""
        for block in blocks:
            if self._refs[block] == 0:
                self._free_cached.pop(block, None)
                self.used += 1
            self._refs[block] += 1

    def allocate(self, count: int) -> list[int]:
        """`count` fresh blocks, evicting LRU cached blocks if needed."""
        if count > self.free:
            raise OutOfBlocks(f"asked for {count} blocks, {self.free} free")
        taken: list[int] = []
        removed: list[int] = []
        for _ in range(count):
            if self._free_plain:
                block = self._free_plain.popleft()
            else:
                block, _ = self._free_cached.popitem(last=False)
                removed.extend(self._uncache(block))
            self._refs[block] = 1
            taken.append(block)
        self.used += count
        if removed and self._listener is not None:
            self._listener.removed(removed)
        return taken

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one reference on each block, tail first (evicted first)."""
        for block in reversed(blocks):
            self._refs[block] -= 1
            if self._refs[block] < 0:
                raise RuntimeError(f"block {block} released more often than taken")
            if self._refs[block] == 0:
                self.used -= 1
                if self._key[block] is not None:
                    self._free_cached[block] = None
                else:
                    self._free_plain.append(block)

    def cache(self, block: int, key: int, hashes: tuple[int, ...]) -> bool:
        """Enter a just-filled block into the prefix cache; False when an
        equal block is cached already (the duplicate stays private, as in vLLM)."""
        if key in self._cached or self._key[block] is not None:
            return False
        self._key[block] = key
        self._hashes[block] = hashes
        self._cached[key] = block
        if self._listener is not None:
            self._listener.stored(list(hashes))
        return True

    def clear(self) -> None:
        """Forget every cached prefix (blocks in use stay in use, uncached)."""
        for block in list(self._cached.values()):
            self._uncache(block)
            if block in self._free_cached:
                del self._free_cached[block]
                self._free_plain.append(block)
        if self._listener is not None:
            self._listener.cleared()

    def _uncache(self, block: int) -> tuple[int, ...]:
        key = self._key[block]
        self._key[block] = None
        if key is not None:
            del self._cached[key]
        return self._hashes.pop(block, ())
