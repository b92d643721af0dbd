"""One engine in steady state under continuous batching, from its step-cost
profile: the batch it settles at for a given arrival rate, its step time
(the time per output token), and the share of its time prefill takes.

The profile has the shape of both the simulator's cost model
(engine/sim/cost_model.py) and the engine's own step fit
(engine/step_speed.py):

    step seconds = fixed + c x (per_sequence + per_kilotoken x context / 1000)
                   + prefill tokens x per_prefill_token

With requests arriving at `rate` per second, each prefilling `prompt`
uncached tokens and decoding `output` tokens, the engine spends the share
rho_p = rate x prompt x per_prefill_token of its time on prefill and the rest
stepping its decode batch. A request decodes for `output` steps of
s = (fixed + c x a) / (1 - rho_p) seconds each (a: the per-sequence cost at
the mean context), so by Little's law the batch is c = rate x output x s.
Solved for c:

    q = rate x output / (1 - rho_p);    c = q x fixed / (1 - q x a)

finite while q x a < 1; past that, or past the batch cap, the engine cannot
keep up and its queue grows without bound.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from services.common.config import MeshConfig, SimCostConfig

__all__ = ["EngineLoad", "EngineProfile", "Workload", "steady_state"]


@dataclass(frozen=True)
class EngineProfile:
    """What one engine's steps cost, and its limits."""

    name: str
    fixed_seconds: float           # a step's cost whatever the batch
    per_sequence_seconds: float    # each decoding sequence's share of a step
    per_kilotoken_seconds: float   # per 1k tokens of context summed over the batch
    per_prefill_token_seconds: float
    chunk_tokens: int              # most tokens one step computes
    max_running: int               # the batch cap (sequences)
    kv_tokens: int                 # KV cache capacity in tokens (0 = unknown)

    @classmethod
    def from_sim(cls, name: str, cost: SimCostConfig, max_running: int, kv_tokens: int) -> EngineProfile:
        f = cost.speed_factor
        return cls(name, cost.decode_seconds_per_step * f, cost.decode_seconds_per_sequence * f,
                   cost.decode_seconds_per_kilotoken_context * f, cost.prefill_seconds_per_token * f,
                   cost.chunk_tokens, max_running, kv_tokens)

    @classmethod
    def from_config(cls, config: MeshConfig) -> EngineProfile:
        """The sim engines of a mesh config (config/kvmesh.yaml's template)."""
        t = config.engines.template
        return cls.from_sim("config sim engine", t.sim, t.max_running, t.total_blocks * t.block_size)


@dataclass(frozen=True)
class Workload:
    rate: float              # requests per second, the whole fleet
    prompt_tokens: float     # mean prompt length
    output_tokens: float     # mean output length
    cached_fraction: float   # of a prompt's tokens found in the prefix cache when it hits
    hit_rate: float = 1.0    # of requests that find their prefix cached

    @property
    def prefill_tokens(self) -> float:
        """Mean uncached prompt tokens per request."""
        return self.prompt_tokens * (1.0 - self.cached_fraction * self.hit_rate)

    def prefill_tokens_at(self, quantile: float) -> float:
        """Uncached prompt tokens of the request at `quantile`: the whole
        prompt once misses are more than 1 - quantile of the requests."""
        missed = 1.0 - self.hit_rate if self.cached_fraction > 0 else 0.0
        return self.prompt_tokens if missed > 1.0 - quantile else self.prompt_tokens * (1.0 - self.cached_fraction)

    @property
    def mean_context(self) -> float:
        """A decoding sequence's context, averaged over its decode."""
        return self.prompt_tokens + self.output_tokens / 2.0


@dataclass(frozen=True)
class EngineLoad:
    """One engine's steady state at `rate` requests per second."""

    rate: float
    prefill_share: float     # rho_p
    batch: float             # c, mean decoding sequences
    step_seconds: float      # s, seconds per output token
    decode_seconds: float    # output x s
    prefill_seconds: float   # one mean prompt's prefill, in chunks alongside the batch
    decode_step_seconds: float  # a step of the batch without prefill (fixed + c x a)
    chunk_room: float        # prompt tokens one step takes beside the batch
    per_prefill_token_seconds: float
    kv_tokens: float         # KV held by the batch
    stable: bool             # finite batch within the cap and the KV

    @property
    def service_seconds(self) -> float:
        """A request's time on the engine, first step to last token."""
        return self.prefill_seconds + self.decode_seconds

    def prefill_seconds_for(self, tokens: float) -> float:
        """Prefilling `tokens` in chunks, each step also decoding the batch."""
        chunks = math.ceil(tokens / self.chunk_room) if tokens > 0 else 1
        return chunks * self.decode_step_seconds + tokens * self.per_prefill_token_seconds


def steady_state(profile: EngineProfile, workload: Workload, rate: float) -> EngineLoad:
    """The engine at `rate` requests per second of `workload`."""
    a = profile.per_sequence_seconds + profile.per_kilotoken_seconds * workload.mean_context / 1000.0
    rho_p = rate * workload.prefill_tokens * profile.per_prefill_token_seconds
    batch, step, ok = math.inf, math.inf, False
    if rho_p < 1.0:
        q = rate * workload.output_tokens / (1.0 - rho_p)
        if q * a < 1.0:
            batch = q * profile.fixed_seconds / (1.0 - q * a)
            step = (profile.fixed_seconds + batch * a) / (1.0 - rho_p)
            ok = batch <= profile.max_running
    kv = batch * workload.mean_context
    ok = ok and (profile.kv_tokens <= 0 or kv <= profile.kv_tokens)
    chunk_room = max(1.0, profile.chunk_tokens - (batch if math.isfinite(batch) else 0.0))
    decode_step = profile.fixed_seconds + (batch if math.isfinite(batch) else profile.max_running) * a
    load = EngineLoad(rate, rho_p, batch, step, workload.output_tokens * step, 0.0, decode_step, chunk_room,
                      profile.per_prefill_token_seconds, kv, ok)
    return dataclasses.replace(load, prefill_seconds=load.prefill_seconds_for(workload.prefill_tokens))
