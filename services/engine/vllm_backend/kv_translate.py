"""vLLM's KV-cache events -> the shared prefix-hash space.

vLLM names its blocks by its own hashes (bytes or ints) and publishes, for
each newly cached block, its hash, its parent's hash and its token ids. The
scheduler matches prompts by `block_hashes(tokens, hash_block_tokens)`, so
each vLLM block is re-hashed here: its tokens chained onto the last of its
parent's shared hashes. One vLLM block of `block_size` tokens covers
`block_size / hash_block_tokens` shared hashes.

The translator is pure state (no I/O, no vLLM import) so it can be tested on
its own; `KvEventSubscriber` feeds it from vLLM's ZMQ publisher.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from services.common.prefix_hash import ROOT_HASH, block_hashes

__all__ = ["KvDelta", "KvOp", "KvTranslator"]


KvOp = Literal["stored", "removed", "cleared"]


@dataclass
class KvDelta:
    """What one batch of vLLM events changed, in shared hashes, in order
    (a hash removed then stored again in one batch must end up held)."""

    ops: list[tuple[KvOp, list[int]]] = field(default_factory=list)

    def add(self, op: KvOp, hashes: list[int] | None = None) -> None:
        if op == "cleared":
            self.ops = [("cleared", [])]  # everything before it is moot
            return
        if not hashes:
            return
        if self.ops and self.ops[-1][0] == op:
            self.ops[-1][1].extend(hashes)
        else:
            self.ops.append((op, list(hashes)))

    def empty(self) -> bool:
        return not self.ops


class KvTranslator:
    """Owns the map vLLM block hash -> shared hashes it covers.

    Shared hashes are reference-counted: two vLLM blocks could only carry the
    same shared hash if vLLM hashed extra keys we do not (LoRA, cache salt),
    and the hash must stay reported until the last of them is gone.
    Blocks whose parent is unknown (events missed) are skipped: reporting
    less than the cache holds only costs affinity, reporting more would
    misplace requests.
    """

    def __init__(self, block_size: int, hash_block_tokens: int) -> None:
        if block_size <= 0 or hash_block_tokens <= 0 or block_size % hash_block_tokens:
            raise ValueError(
                f"vLLM block size {block_size} must be a positive multiple of "
                f"hash_block_tokens {hash_block_tokens}"
            )
        self.block_size = block_size
        self.hash_block_tokens = hash_block_tokens
        self._blocks: dict[Hashable, tuple[int, ...]] = {}
        self._refs: Counter[int] = Counter()
        self.skipped_orphans = 0

    @property
    def num_blocks(self) -> int:
        """vLLM blocks currently known to be in the prefix cache."""
        return len(self._blocks)

    def snapshot(self) -> list[int]:
        """Every shared hash held now, in no particular order."""
        return list(self._refs)

    def clear(self) -> KvDelta:
        self._blocks.clear()
        self._refs.clear()
        delta = KvDelta()
        delta.add("cleared")
        return delta

    def apply(self, events: Sequence[Any]) -> KvDelta:
        """Apply one batch of vLLM events (BlockStored / BlockRemoved /
        AllBlocksCleared, duck-typed by class name)."""
        delta = KvDelta()
        for event in events:
            kind = type(event).__name__
            if kind == "BlockStored":
                self._stored(event, delta)
            elif kind == "BlockRemoved":
                self._removed(event, delta)
            elif kind == "AllBlocksCleared":
                self.clear()
                delta.add("cleared")
        return delta

    def _stored(self, event: Any, delta: KvDelta) -> None:
        if getattr(event, "group_idx", None) not in (None, 0):
            return  # a second KV-cache group (sliding window...) repeats the same tokens
        size = int(event.block_size)
        if size % self.hash_block_tokens:
            self.skipped_orphans += len(event.block_hashes)
            return
        parent_key = event.parent_block_hash
        if parent_key is None:
            parent = ROOT_HASH
        else:
            parent_hashes = self._blocks.get(_key(parent_key))
            if not parent_hashes:
                self.skipped_orphans += len(event.block_hashes)
                return
            parent = parent_hashes[-1]
        tokens = list(event.token_ids)
        per_block = size // self.hash_block_tokens
        ours = block_hashes(tokens, self.hash_block_tokens, parent=parent)
        stored: list[int] = []
        for i, vllm_hash in enumerate(event.block_hashes):
            chunk = tuple(ours[i * per_block : (i + 1) * per_block])
            if len(chunk) < per_block:
                break  # token ids shorter than announced: nothing trustworthy left
            key = _key(vllm_hash)
            if key in self._blocks:
                continue  # a reuse report of a block we already hold
            self._blocks[key] = chunk
            for h in chunk:
                self._refs[h] += 1
                if self._refs[h] == 1:
                    stored.append(h)
        delta.add("stored", stored)

    def _removed(self, event: Any, delta: KvDelta) -> None:
        if getattr(event, "group_idx", None) not in (None, 0):
            return
        removed: list[int] = []
        for vllm_hash in event.block_hashes:
            chunk = self._blocks.pop(_key(vllm_hash), None)
            for h in chunk or ():
                self._refs[h] -= 1
                if self._refs[h] <= 0:
                    del self._refs[h]
                    removed.append(h)
        delta.add("removed", removed)


def _key(block_hash: Any) -> Hashable:
    # msgspec decodes bytes hashes as bytes and int ones as int; lists would
    # not be hashable, so normalise defensively.
    if isinstance(block_hash, list):
        return tuple(block_hash)
    return block_hash
