"""Seeded workloads and arrival processes for `kvmesh bench`.

A workload is a list of `Conversation`s, each one or more `Turn`s; a
single-shot request is a conversation of one turn. Everything is a pure
function of the spec and its seed (one `random.Random(seed)` drawn in a fixed
order), so two runs -- or kvmesh and a peer router -- see the very same
prompts, priorities and arrival times.

Kinds:
  shared_prefix   `groups` tenants, each with a long system context of about
                  `context_tokens` tokens, and short questions (RAG / agents)
  multi_turn      chats of `turns` turns; each turn resends the whole history
                  plus the assistant's actual answer, so the prefix grows
  mixed_priority  shared_prefix traffic with an X-Priority per request drawn
                  from `priority_mix` (P0, P1, P2 fractions)
  long_output     decode-heavy: `long_fraction` of requests ask for
                  `long_max_tokens`, the rest are short; unique prompts

Arrivals (`ArrivalSpec`): Poisson (exponential gaps) or gamma gaps (shape k:
coefficient of variation 1/sqrt(k); k < 1 is burstier than Poisson) at `rate`
conversations/s -- open loop, the client never slows down for the server --
or closed loop: `concurrency` workers each start the next conversation when
their last one ends.
"""

from __future__ import annotations

import enum
import random
from collections.abc import Callable
from dataclasses import dataclass

__all__ = [
    "Arrival",
    "ArrivalSpec",
    "Conversation",
    "TokenCounter",
    "Turn",
    "WorkloadKind",
    "WorkloadSpec",
    "arrival_offsets",
    "build_workload",
]

TokenCounter = Callable[[str], int]

# Plain English words; with SmolLM2's / Llama's tokenizers almost every one is
# a single token with its leading space, so word counts track token counts.
_WORDS = (
    "the system shall answer every question about the attached contract using only its clauses "
    "cite section numbers quote exact figures and refuse to speculate when the document is silent "
    "river mountain ledger invoice parcel harbor customs tariff warranty liability indemnity "
    "schedule appendix delivery acceptance payment interest penalty termination renewal notice "
    "supplier customer carrier insurer auditor regulator tribunal venue governing law clause "
    "report summary table figure chapter data model price order account service market value"
).split()


class WorkloadKind(enum.Enum):
    SHARED_PREFIX = "shared_prefix"
    MULTI_TURN = "multi_turn"
    MIXED_PRIORITY = "mixed_priority"
    LONG_OUTPUT = "long_output"


class Arrival(enum.Enum):
    POISSON = "poisson"
    GAMMA = "gamma"
    CLOSED = "closed"


@dataclass(frozen=True)
class Turn:
    user: str
    max_tokens: int


@dataclass(frozen=True)
class Conversation:
    index: int
    at: float                  # seconds after the start (open loop); 0 in closed loop
    system: str                # "" = no system message
    turns: tuple[Turn, ...]
    priority: int | None       # X-Priority to send; None = no header (server default)
    group: int                 # shared-context group (tenant) it belongs to
    think_seconds: float = 0.0  # pause between a turn's end and the next turn


@dataclass(frozen=True)
class WorkloadSpec:
    kind: WorkloadKind
    conversations: int
    seed: int = 1
    groups: int = 8               # shared contexts (shared_prefix, mixed_priority)
    context_tokens: int = 1500    # tokens of each shared context
    question_words: int = 16      # words of each user message
    max_tokens: int = 16          # answer length of ordinary requests
    turns: int = 4                # multi_turn: turns per chat
    think_seconds: float = 0.0    # multi_turn: pause between turns
    long_fraction: float = 0.3    # long_output: share of long answers
    long_max_tokens: int = 512    # long_output: their length
    # P0, P1, P2; any length is accepted here and rejected below unless it is 3
    # (the CLI passes whatever the user typed).
    priority_mix: tuple[float, ...] = (0.2, 0.3, 0.5)
    salt: str = ""                # prepended to every context: a fresh cache per run

    def __post_init__(self) -> None:
        if self.conversations <= 0:
            raise ValueError("conversations must be >= 1")
        if self.groups <= 0 or self.turns <= 0 or self.max_tokens <= 0:
            raise ValueError("groups, turns and max_tokens must be >= 1")
        if len(self.priority_mix) != 3 or min(self.priority_mix) < 0 or sum(self.priority_mix) <= 0:
            raise ValueError("priority_mix: three non-negative fractions (P0, P1, P2), not all 0")
        if not 0.0 <= self.long_fraction <= 1.0:
            raise ValueError("long_fraction must be in [0, 1]")


@dataclass(frozen=True)
class ArrivalSpec:
    kind: Arrival = Arrival.POISSON
    rate: float = 10.0         # conversations per second (open loop)
    gamma_shape: float = 1.0   # gamma only: 1 = Poisson, < 1 burstier
    concurrency: int = 8       # closed loop: conversations in flight

    def __post_init__(self) -> None:
        if self.kind is Arrival.CLOSED:
            if self.concurrency <= 0:
                raise ValueError("concurrency must be >= 1 for closed-loop arrivals")
        elif self.rate <= 0:
            raise ValueError("rate must be > 0 for open-loop arrivals")
        if self.gamma_shape <= 0:
            raise ValueError("gamma_shape must be > 0")


def arrival_offsets(spec: ArrivalSpec, n: int, rng: random.Random) -> list[float]:
    """Start offsets (seconds) of n conversations; all 0 for closed loop."""
    if spec.kind is Arrival.CLOSED:
        return [0.0] * n
    out, t = [], 0.0
    for _ in range(n):
        if spec.kind is Arrival.POISSON:
            t += rng.expovariate(spec.rate)
        else:  # gamma with mean 1/rate: scale = 1 / (shape * rate)
            t += rng.gammavariate(spec.gamma_shape, 1.0 / (spec.gamma_shape * spec.rate))
        out.append(t)
    return out


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(n))


def _context(rng: random.Random, group: int, tokens: int, salt: str, count: TokenCounter | None) -> str:
    head = f"{salt}Group {group} reference document {rng.randrange(10**6)}."
    if count is None:  # about one token per word
        return head + " " + _words(rng, max(0, tokens - 6))
    parts = [head]
    while count(" ".join(parts)) < tokens:
        parts.append(_words(rng, 32))
    return " ".join(parts)


def _priority(rng: random.Random, mix: tuple[float, ...]) -> int:
    return rng.choices((0, 1, 2), weights=mix)[0]


def build_workload(
    spec: WorkloadSpec, arrival: ArrivalSpec, count_tokens: TokenCounter | None = None
) -> list[Conversation]:
    """The seeded workload. `count_tokens` (a tokenizer's length) makes shared
    contexts hit `context_tokens` exactly; without it words stand in for tokens."""
    rng = random.Random(spec.seed)
    offsets = arrival_offsets(arrival, spec.conversations, rng)
    kind = spec.kind
    shared = kind in (WorkloadKind.SHARED_PREFIX, WorkloadKind.MIXED_PRIORITY)
    contexts = (
        [_context(rng, g, spec.context_tokens, spec.salt, count_tokens) for g in range(spec.groups)]
        if shared else []
    )
    out = []
    for i, at in enumerate(offsets):
        group = rng.randrange(spec.groups)
        question = f"Question {i}: {_words(rng, spec.question_words)}?"
        priority = _priority(rng, spec.priority_mix) if kind is WorkloadKind.MIXED_PRIORITY else None
        if shared:
            conv = Conversation(i, at, contexts[group], (Turn(question, spec.max_tokens),), priority, group)
        elif kind is WorkloadKind.MULTI_TURN:
            system = f"{spec.salt}You are assistant {group} for chat {i}. Answer briefly."
            turns = tuple(
                Turn(f"Turn {k} of chat {i}: {_words(rng, spec.question_words)}?", spec.max_tokens)
                for k in range(spec.turns)
            )
            conv = Conversation(i, at, system, turns, None, group, spec.think_seconds)
        else:  # LONG_OUTPUT
            long = rng.random() < spec.long_fraction
            max_tokens = spec.long_max_tokens if long else spec.max_tokens
            conv = Conversation(i, at, f"{spec.salt}Write at length.", (Turn(question, max_tokens),),
                                None, group)
        out.append(conv)
    return out
