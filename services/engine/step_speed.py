"""The engine's own step speed, measured from its steps, for the load report
(LoadReport fields 310-312; placement's `predicted_ttft` reads them).

Each step's wall time is fitted against the prompt tokens it prefilled and
the sequences it decoded, least squares with exponentially decayed weights:

    seconds ~= fixed + sequences x per_sequence + prefill_tokens / prefill_tokens_per_second

so the prefill slope is the marginal prefill cost (what one more uncached
prompt token costs on THIS engine), `per_sequence` what one more running
sequence adds to every step (its decode), and `fixed` what a step costs
anyway. The sim's cost model (sim/cost_model.py) has exactly this shape.
A plain tokens / seconds ratio was no use: with shared prefixes most steps
prefill a ~30-token tail and decode the rest, and that ratio says ~700
tok/s on an engine that prefills ~4,700 tok/s (the benchmark's sim at
speed_factor 4: 52.9 us x 4 per token).

The step time reported is the fit at the engine's batch NOW
(`step_seconds_at(running)`). It was the intercept over the recent steps,
i.e. at their batch: an engine that went idle kept reporting its last busy
batch's step time, so of two idle engines the one busy last looked slower
by its old decode load, and a burst of short prompts went whole to the
other (seen on two vLLM-CPU engines, where a sequence adds ~10% to a step).

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
# A slope is refitted only while the recent steps spread along it: prefill
# sizes by at least this many tokens, batch sizes by this many sequences
# (standard deviations). With all steps alike (pure decode at one batch) a
# slope is undefined and the last good one is kept.
_MIN_SPREAD_TOKENS = 16.0
_MIN_SPREAD_SEQUENCES = 0.5
# Both slopes are solved together only while prefill size and batch size are
# not nearly collinear (squared correlation below this); otherwise each is
# refitted alone, the other held at its last good value.
_MAX_COLLINEARITY = 0.9


@dataclass
class StepSpeed:
    decay: float = _DECAY
    weight: float = 0.0
    sum_x: float = 0.0    # x: prompt tokens prefilled in the step
    sum_s: float = 0.0    # s: sequences decoded in the step
    sum_y: float = 0.0    # y: the step's seconds
    sum_xx: float = 0.0
    sum_ss: float = 0.0
    sum_xs: float = 0.0
    sum_xy: float = 0.0
    sum_sy: float = 0.0
    seconds_per_token: float = 0.0      # last good prefill slope; 0 = never measured
    seconds_per_sequence: float = 0.0   # last good decode slope; 0 = never measured
    budget_tokens: int = 0              # most tokens one step may compute (0 = unknown)

    def observe(self, seconds: float | None, prefill_tokens: int, sequences: int = 0) -> None:
        """One step: its wall time (None / <= 0: not measured, ignored), the
        prompt tokens it prefilled and the sequences it decoded."""
        if seconds is None or seconds <= 0:
            return
        keep = 1.0 - self.decay
        x, z = float(prefill_tokens), float(sequences)
        self.weight = self.weight * keep + 1.0
        self.sum_x = self.sum_x * keep + x
        self.sum_s = self.sum_s * keep + z
        self.sum_y = self.sum_y * keep + seconds
        self.sum_xx = self.sum_xx * keep + x * x
        self.sum_ss = self.sum_ss * keep + z * z
        self.sum_xs = self.sum_xs * keep + x * z
        self.sum_xy = self.sum_xy * keep + x * seconds
        self.sum_sy = self.sum_sy * keep + z * seconds
        self._refit()

    def _refit(self) -> None:
        w = self.weight
        mx, ms, my = self.sum_x / w, self.sum_s / w, self.sum_y / w
        cxx, css = self.sum_xx / w - mx * mx, self.sum_ss / w - ms * ms
        cxs, cxy, csy = self.sum_xs / w - mx * ms, self.sum_xy / w - mx * my, self.sum_sy / w - ms * my
        spread_x, spread_s = cxx >= _MIN_SPREAD_TOKENS ** 2, css >= _MIN_SPREAD_SEQUENCES ** 2
        if spread_x and spread_s and cxs * cxs < _MAX_COLLINEARITY * cxx * css:
            det = cxx * css - cxs * cxs
            per_token, per_sequence = (cxy * css - csy * cxs) / det, (csy * cxx - cxy * cxs) / det
        else:
            # one slope at a time, the other at its last good value
            per_token = (cxy - self.seconds_per_sequence * cxs) / cxx if spread_x else 0.0
            per_sequence = (csy - self.seconds_per_token * cxs) / css if spread_s else -1.0
        if per_token > 0:
            self.seconds_per_token = per_token
        if spread_s and per_sequence >= 0:
            self.seconds_per_sequence = per_sequence

    @property
    def prefill_tokens_per_second(self) -> float:
        """Marginal prefill speed; 0 = not measured yet."""
        return 1.0 / self.seconds_per_token if self.seconds_per_token > 0 else 0.0

    def step_seconds_at(self, sequences: float) -> float:
        """A step's time without prefill with `sequences` decoding; 0 = unknown."""
        if self.weight <= 0:
            return 0.0
        w = self.weight
        fixed = (self.sum_y - self.seconds_per_token * self.sum_x - self.seconds_per_sequence * self.sum_s) / w
        return max(0.0, fixed + self.seconds_per_sequence * sequences)

    @property
    def step_seconds(self) -> float:
        """A step's time without prefill at the recent steps' mean batch; 0 = unknown."""
        return self.step_seconds_at(self.sum_s / self.weight) if self.weight > 0 else 0.0
