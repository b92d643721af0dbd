"""The engine's own step speed, measured from its steps, for the load report
(LoadReport fields 310-312; placement's `predicted_ttft` reads them).

Each step's wall time is fitted against the prompt tokens it prefilled,
least squares with exponentially decayed weights:

    seconds ~= step_seconds + prefill_tokens / prefill_tokens_per_second

so the slope is the marginal prefill cost (what one more uncached prompt
token costs on THIS engine) and the intercept what a step costs anyway
(fixed cost plus the decode load of the running batch: the sim's cost model,
sim/cost_model.py, has exactly this shape). A plain tokens / seconds ratio
was no use: with shared prefixes most steps prefill a ~30-token tail and
decode the rest, and that ratio says ~700 tok/s on an engine that prefills
~4,700 tok/s (the benchmark's sim at speed_factor 4: 52.9 us x 4 per token).

The scheduler's fixed `prefill_tokens_per_second` (20,000) was 4x off for
that sim; a real GPU differs by model, by batch and over time (a throttled
card), which a fixed figure cannot follow.

Ownership: one `StepSpeed` per backend, fed on the event loop thread (sim:
its step loop; vLLM: its stat logger). Cheap: O(1) per step.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["StepSpeed"]

# Weight of the newest step: ~50 steps of memory (2-3 s of a sim engine at
# speed_factor 4, 40-150 ms steps), long enough that timer noise on loaded
# cores (a few ms per step) moves the slope by ~10%, short enough to follow a
# slowdown within a few seconds.
_DECAY = 0.02
# The slope is refitted only while the recent steps' prefill sizes spread
# by at least this many tokens (standard deviation): with all steps alike
# (pure decode) the slope is undefined and the last good one is kept.
_MIN_SPREAD_TOKENS = 16.0


@dataclass
class StepSpeed:
    decay: float = _DECAY
    weight: float = 0.0
    sum_x: float = 0.0
    sum_y: float = 0.0
    sum_xx: float = 0.0
    sum_xy: float = 0.0
    seconds_per_token: float = 0.0   # last good slope; 0 = never measured
    budget_tokens: int = 0           # most tokens one step may compute (0 = unknown)

    def observe(self, seconds: float | None, prefill_tokens: int) -> None:
        """One step: its wall time (None / <= 0: not measured, ignored) and
        the prompt tokens it prefilled."""
        if seconds is None or seconds <= 0:
            return
        keep = 1.0 - self.decay
        x = float(prefill_tokens)
        self.weight = self.weight * keep + 1.0
        self.sum_x = self.sum_x * keep + x
        self.sum_y = self.sum_y * keep + seconds
        self.sum_xx = self.sum_xx * keep + x * x
        self.sum_xy = self.sum_xy * keep + x * seconds
        mean_x = self.sum_x / self.weight
        var_x = self.sum_xx / self.weight - mean_x * mean_x
        if var_x >= _MIN_SPREAD_TOKENS ** 2:
            slope = (self.sum_xy / self.weight - mean_x * self.sum_y / self.weight) / var_x
            if slope > 0:
                self.seconds_per_token = slope

    @property
    def prefill_tokens_per_second(self) -> float:
        """Marginal prefill speed; 0 = not measured yet."""
        return 1.0 / self.seconds_per_token if self.seconds_per_token > 0 else 0.0

    @property
    def step_seconds(self) -> float:
        """A step's time without prefill at the recent batch; 0 = unknown."""
        if self.weight <= 0:
            return 0.0
        mean_y = self.sum_y / self.weight
        mean_x = self.sum_x / self.weight
        return max(0.0, mean_y - self.seconds_per_token * mean_x)
