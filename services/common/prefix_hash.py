"""The shared prefix-hash space: chained hashes over full blocks of token ids.

The gateway hashes a prompt, engines hash what their KV cache holds, and the
scheduler matches the two, so all three must call this one function. A block's
hash covers every token before it (each hash chains on its parent), so equal
hashes mean equal prefixes, not just equal blocks.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

__all__ = ["ROOT_HASH", "block_hashes", "chain_hash"]

# Parent of the first block. Any fixed value works; this one is 'kvmesh\0\0'.
ROOT_HASH = 0x6B766D6573680000


def chain_hash(parent: int, tokens: Sequence[int]) -> int:
    """Hash of one block given its parent's hash: a 64-bit BLAKE2b."""
    digest = hashlib.blake2b(
        array("I", tokens).tobytes(), digest_size=8, key=parent.to_bytes(8, "little")
    ).digest()
    return int.from_bytes(digest, "little")


def block_hashes(
    token_ids: Sequence[int], block_tokens: int, parent: int = ROOT_HASH
) -> list[int]:
    """Hashes of every full block of `token_ids`, first block first.

    A trailing partial block has no hash: caches only share full blocks.
    """
    if block_tokens <= 0:
        raise ValueError(f"block_tokens must be positive, got {block_tokens}")
    hashes: list[int] = []
    for start in range(0, len(token_ids) - block_tokens + 1, block_tokens):
        parent = chain_hash(parent, token_ids[start : start + block_tokens])
        hashes.append(parent)
    return hashes
