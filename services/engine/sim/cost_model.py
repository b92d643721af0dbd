"""How long one continuous-batching step of the simulated GPU takes.

A step runs one forward pass over the batch: some prompt tokens being
prefilled (chunked) and one token for each decoding sequence. The model is the
usual roofline split of LLM serving:

* **Prefill is compute-bound.** A dense model needs about 2·N FLOPs per token
  (N = parameters). An 8B model on an A100 (312 TFLOP/s bf16) at ~50% MFU:
  16e9 / 1.56e14 ≈ 100 µs/token; on an H100 (989 TFLOP/s) ≈ 30 µs/token.
  Default `prefill_seconds_per_token` = 50 µs sits between the two.
* **Decode is memory-bound.** Every step reads all weights once, whatever the
  batch: 16 GB of bf16 weights at ~2 TB/s ≈ 8 ms. Default
  `decode_seconds_per_step` = 8 ms (≈125 tokens/s for one sequence, the
  figure commonly measured for 7-8B models on an A100 with vLLM).
* **Per-sequence overhead** (sampling, scheduling, attention launch per
  sequence) ≈ 0.2 ms, after vLLM's own step profiles at batch 64.
* **KV reads grow with context.** Llama-3-8B (GQA, 8 KV heads × 128, 32
  layers, bf16) keeps 128 KiB of KV per token; 1k tokens = 128 MiB ≈ 64 µs
  at 2 TB/s. Default `decode_seconds_per_kilotoken_context` = 50 µs.

Calibrated profile: `config/sim-profiles/llama3-8b-a100.yaml` sets these
constants (and KV blocks, batch cap, chunk budget) for Meta-Llama-3-8B on an
A100-80GB from the `vidur` simulator's published per-layer profiles
(github.com/microsoft/vidur, data/profiling/compute/a100/meta-llama/
Meta-Llama-3-8B/mlp.csv): fixed step 9.78 ms, 29.4 us per decoding sequence,
52.9 us per prefill token, 87 us per 1k context tokens (bandwidth-derived),
chunks of 512, 29,206 16-token blocks. `scripts/calibrate_sim.py` derives
them and `--check` compares the sim's step times with the source's own:
decode batches 1-128 within 3%, prefill of 384+ tokens within 8%, small
prefill chunks (128-256 tokens) 18-25% high (the additive model cannot bend
at the memory-bound knee). services/engine/sim/profiles.py applies a profile.

The constants live in `SimCostConfig` (services/common/config/engines.py).
`speed_factor` multiplies every cost; 0 makes the simulator free (a step still
yields to the event loop, see sim/backend.py), which benchmarks of the mesh's
own overhead and unit tests use.

Speed at run time (sim/speed.py): every step's time is also multiplied by
the sim's current speed factor -- `engines.sim.speed_schedule` (a list of
{at_seconds, factor} counted from the step loop's start, e.g. factor 5 from
60 s: a GPU that slows to a fifth), or set live on the engine's metrics port
with `curl -X POST 'http://127.0.0.1:<metrics_port>/sim/speed?factor=5'`
(`GET` shows it, `DELETE` returns to the schedule; sim engines only). The
deadline tests use it to make the fleet's latency change under the mesh.

n > 1 costs what it costs vLLM: the gateway starts the copies of a request on
the same engine after choice 0's first token (services/gateway/choices.py),
so each copy's prompt is a prefix-cache hit (sim/core.py) and only its last
partial block is prefilled; then n sequences decode, each one per step.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.common.config import SimCostConfig

__all__ = ["StepWork", "step_seconds"]


@dataclass(frozen=True)
class StepWork:
    """What one step computes."""

    prefill_tokens: int = 0        # prompt (or recomputed) tokens this step
    decode_sequences: int = 0      # sequences producing one token by decode
    decode_context_tokens: int = 0  # context length summed over decoding sequences

    @property
    def empty(self) -> bool:
        return self.prefill_tokens == 0 and self.decode_sequences == 0


def step_seconds(cost: SimCostConfig, work: StepWork) -> float:
    """Simulated wall time of one step, >= 0; 0 when speed_factor is 0."""
    if cost.speed_factor <= 0 or work.empty:
        return 0.0
    seconds = (
        cost.decode_seconds_per_step
        + work.prefill_tokens * cost.prefill_seconds_per_token
        + work.decode_sequences * cost.decode_seconds_per_sequence
        + work.decode_context_tokens / 1000.0 * cost.decode_seconds_per_kilotoken_context
    )
    return max(0.0, seconds * cost.speed_factor)
