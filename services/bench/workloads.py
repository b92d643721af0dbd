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
  cache_pressure  more distinct contexts than the fleet's KV holds: `groups`
                  contexts of `context_tokens` +- `context_spread`, group
                  popularity Zipf(`zipf`), each session `turns` growing turns
                  (history + actual answers) on top of its group's context.
                  `spec_for(CACHE_PRESSURE, n)` gives the benchmark's shape,
                  see "The cache-pressure workload" below.

The cache-pressure workload (`spec_for(WorkloadKind.CACHE_PRESSURE, n)`),
sized for the benchmark fleet of scripts/bench_peers.py: 8 sim engines x 640
KV blocks x 16 tokens = 10,240 tokens per engine, 81,920 fleet-wide.
  * 64 groups, contexts uniform in 2,000..4,000 tokens (3,000 +- 1/3): ~192k
    distinct context tokens, ~19x one engine's KV and ~2.3x the fleet's. One
    engine holds 2-5 contexts (fewer while sessions run on top of them), so
    whichever router cannot keep every group warm: it must choose which.
  * Group popularity Zipf(0.8): group k (k = 1..64) with weight k**-0.8.
    0.8 sits in the 0.6-0.9 range measured for content popularity (web
    caches, Breslau et al. 1999) and gives a hot head a router can exploit
    and a long tail it cannot: the top group draws 14% of sessions, the top
    8 (one per engine) 46%, the top 27 (~the fleet's KV in 3k contexts) 74%,
    so ~1/4 of sessions start on a context no placement keeps cached. At 1.0
    the top 27 draw 82% (little pressure left); at 0.6 only 66% (mostly cold
    prefills, whatever the router).
  * Sessions of 4 turns (as multi_turn), each resending the history with the
    actual answer (24-word questions, 32-token answers, 1 s think time
    between turns): a session's own KV grows on top of its group's and is
    lost if evicted during the think time. Only a session's first turn can
    find its group's context cold, so the ~1/4 of sessions on cold groups are
    ~6% of requests: p90 TTFT measures placement (hits and queueing), p99
    the cold prefills (2-4k tokens: 0.6-1.2 s each at speed 4).
  * Rate: CACHE_PRESSURE_RATE = 2.5 sessions/s (10 requests/s).

Capacity (measured under `flock /work/wt/bench19.lock`: bench_peers' mesh --
8 sim engines, llama3-8b-a100 at speed 4, 640 blocks -- kvmesh's
sticky_until_saturated, 150 sessions per rate after a 40-session warm-up of
the same contexts; TTFT p50/p90/p99, requests/s done, prefix hit rate):
  2.0 sessions/s ( 8 req/s):  99 /  874 / 1764 ms,  7.8 req/s, 85.9%
  2.5 sessions/s (10 req/s): 111 / 1029 / 2608 ms,  9.1 req/s, 82.3%
  3.0 sessions/s (12 req/s): 128 / 1480 / 3053 ms, 10.5 req/s, 77.7%
With 3 turns, 5 sessions/s (15 req/s) was past capacity (9.7 req/s done, p50
1.0 s, hits down to 53%: spilled requests evict the hot contexts) and 7/s
collapsed (8.1 req/s, 39%). Hits fall as load rises: the fleet's capacity on
this workload is ~12-13 requests/s for this router, so 2.5 sessions/s is near
(~80%) but under it. The floor of the 2.5/s run (services/bench/floor.py):
55 / 75 / 984 ms at 93.5% hits (unbounded KV), 55 / 77 / 984 ms at 92.5%
(the fleet's own KV pooled, clairvoyant eviction).

Arrivals (`ArrivalSpec`): Poisson (exponential gaps) or gamma gaps (shape k:
coefficient of variation 1/sqrt(k); k < 1 is burstier than Poisson) at `rate`
conversations/s -- open loop, the client never slows down for the server --
or closed loop: `concurrency` workers each start the next conversation when
their last one ends.
"""

from __future__ import annotations

import enum
import itertools
import random
from collections.abc import Callable
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

__all__ = [
    "CACHE_PRESSURE_RATE",
    "Arrival",
    "ArrivalSpec",
    "Conversation",
    "TokenCounter",
    "Turn",
    "WorkloadKind",
    "WorkloadSpec",
    "arrival_offsets",
    "build_workload",
    "spec_for",
    "zipf_weights",
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


# The cache-pressure benchmark's shape (module docstring); read-only.
_PRESSURE_DEFAULTS = MappingProxyType({
    "groups": 64, "context_tokens": 3000, "context_spread": 1 / 3, "zipf": 0.8,
    "turns": 4, "question_words": 24, "max_tokens": 32, "think_seconds": 1.0,
})
# Sessions per second recommended for the cache-pressure benchmark (x 4 turns = 10 requests/s):
# ~80% of the fleet's capacity under kvmesh's default policy (module docstring, "Capacity").
CACHE_PRESSURE_RATE = 2.5


class WorkloadKind(enum.Enum):
    SHARED_PREFIX = "shared_prefix"
    MULTI_TURN = "multi_turn"
    MIXED_PRIORITY = "mixed_priority"
    LONG_OUTPUT = "long_output"
    CACHE_PRESSURE = "cache_pressure"


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
    zipf: float = 0.8             # cache_pressure: group k (from 1) drawn with weight k**-zipf
    context_spread: float = 0.0   # cache_pressure: context lengths uniform in tokens * (1 +- spread)

    def __post_init__(self) -> None:
        if self.conversations <= 0:
            raise ValueError("conversations must be >= 1")
        if self.groups <= 0 or self.turns <= 0 or self.max_tokens <= 0:
            raise ValueError("groups, turns and max_tokens must be >= 1")
        if len(self.priority_mix) != 3 or min(self.priority_mix) < 0 or sum(self.priority_mix) <= 0:
            raise ValueError("priority_mix: three non-negative fractions (P0, P1, P2), not all 0")
        if not 0.0 <= self.long_fraction <= 1.0:
            raise ValueError("long_fraction must be in [0, 1]")
        if self.zipf < 0 or not 0.0 <= self.context_spread < 1.0:
            raise ValueError("zipf must be >= 0 and context_spread in [0, 1)")


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


def _long_context(rng: random.Random, group: int, tokens: int, salt: str, count: TokenCounter | None) -> str:
    """A context of at least `tokens` tokens (the fewest words that reach it):
    a binary search over a prefix of `tokens` drawn words (each word is >= 1
    token), ~12 tokenizer calls where _context's top-up loop makes ~100."""
    head = f"{salt}Group {group} reference document {rng.randrange(10**6)}."
    words = [rng.choice(_WORDS) for _ in range(tokens)]
    if count is None:
        return " ".join([head, *words[: max(0, tokens - 6)]])
    lo, hi = 0, tokens
    while lo < hi:
        mid = (lo + hi) // 2
        if count(" ".join([head, *words[:mid]])) >= tokens:
            hi = mid
        else:
            lo = mid + 1
    return " ".join([head, *words[:lo]])


def _priority(rng: random.Random, mix: tuple[float, ...]) -> int:
    return rng.choices((0, 1, 2), weights=mix)[0]


def zipf_weights(n: int, s: float) -> list[float]:
    """Popularity of ranks 1..n under Zipf(s): weight k**-s, normalized."""
    raw = [k ** -s for k in range(1, n + 1)]
    total = sum(raw)
    return [w / total for w in raw]


def spec_for(kind: WorkloadKind, conversations: int, **overrides: Any) -> WorkloadSpec:
    """A spec with the kind's own defaults (CACHE_PRESSURE: the benchmark's
    shape, module docstring) under `overrides` (None values are ignored, so a
    CLI can pass its unset flags)."""
    fields: dict[str, Any] = dict(_PRESSURE_DEFAULTS) if kind is WorkloadKind.CACHE_PRESSURE else {}
    fields.update({k: v for k, v in overrides.items() if v is not None})
    return WorkloadSpec(kind, conversations, **fields)


def _pressure_workload(
    spec: WorkloadSpec, offsets: list[float], rng: random.Random, count: TokenCounter | None
) -> list[Conversation]:
    """CACHE_PRESSURE: contexts of varied length, Zipf group popularity, growing sessions."""
    lo = max(1, round(spec.context_tokens * (1 - spec.context_spread)))
    hi = max(lo, round(spec.context_tokens * (1 + spec.context_spread)))
    # The contexts come from their own stream: the same for any number of
    # sessions and any arrivals (a warm-up run of fewer sessions warms them).
    ctx_rng = random.Random(f"contexts {spec.seed}")
    contexts = [_long_context(ctx_rng, g, ctx_rng.randint(lo, hi), spec.salt, count) for g in range(spec.groups)]
    cum = list(itertools.accumulate(zipf_weights(spec.groups, spec.zipf)))
    out = []
    for i, at in enumerate(offsets):
        group = rng.choices(range(spec.groups), cum_weights=cum)[0]
        turns = tuple(
            Turn(f"Session {i} turn {k}: {_words(rng, spec.question_words)}?", spec.max_tokens)
            for k in range(spec.turns)
        )
        out.append(Conversation(i, at, contexts[group], turns, None, group, spec.think_seconds))
    return out


def build_workload(
    spec: WorkloadSpec, arrival: ArrivalSpec, count_tokens: TokenCounter | None = None
) -> list[Conversation]:
    """The seeded workload. `count_tokens` (a tokenizer's length) makes shared
    contexts hit `context_tokens` exactly; without it words stand in for tokens."""
    rng = random.Random(spec.seed)
    offsets = arrival_offsets(arrival, spec.conversations, rng)
    kind = spec.kind
    if kind is WorkloadKind.CACHE_PRESSURE:
        return _pressure_workload(spec, offsets, rng, count_tokens)
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
