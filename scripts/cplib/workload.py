"""What the synthetic gateways ask for and the synthetic engines cache: a few
shared contexts (a system prompt, a document) plus a short unique tail per
request, hashed in the mesh's prefix-hash space (services/common/prefix_hash.py)
exactly as the gateway hashes a prompt, so the scheduler's KV index matches
admissions against the engines' KV events as it does in a real mesh.

Both sides build the contexts from the same seed; a request names its
context by index to the engine it is placed on (engines.py)."""

from __future__ import annotations

import random
from dataclasses import dataclass

from services.common.prefix_hash import block_hashes

__all__ = ["Workload", "context_hashes"]


@dataclass(frozen=True)
class Workload:
    """The request mix (defaults: scripts/bench_scheduler.py's)."""

    groups: int = 64                 # shared contexts
    context_tokens: int = 2000       # tokens of each shared context
    tail_blocks: int = 2             # unique full blocks after it
    max_tokens: int = 16
    hash_block_tokens: int = 16
    model: str = "m"
    seed: int = 1

    @property
    def prompt_tokens(self) -> int:
        return self.context_tokens + self.tail_blocks * self.hash_block_tokens

    def pick(self, rng: random.Random) -> tuple[int, int, tuple[int, ...]]:
        """(group, priority, tail hashes) of one request."""
        group = rng.randrange(self.groups)
        tail = tuple(rng.getrandbits(63) for _ in range(self.tail_blocks))
        return group, rng.choice((0, 1, 1, 2)), tail


def context_hashes(workload: Workload) -> list[tuple[int, ...]]:
    """Per shared context, its block hashes, first block first."""
    out = []
    for g in range(workload.groups):
        tokens = [(workload.seed * 1_000_003 + g * 7919 + i) % 49152 for i in range(workload.context_tokens)]
        out.append(tuple(block_hashes(tokens, workload.hash_block_tokens)))
    return out
