"""What each model is asked for, measured where the scheduler sees it: the
arrival rate per class (admissions), the mean prompt and output lengths and
the share of prompt tokens found cached (the gateways' RequestDone usage).

Counts accumulate between two decisions at O(1) per request; each decision
(`roll`) turns them into rates smoothed over two time constants: the fast
rate follows a ramp within seconds (scale-out), the slow one must fall too
before engines go (scale-in). Smoothing by time constant, not per roll, so
the figures do not depend on how often the policy decides.

Ownership: owned by `Scaler` (scaler.py), called only from the scheduler
core's one thread.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass, field

from services.scheduler.records import NUM_CLASSES

__all__ = ["DemandMeter", "ModelDemand"]

# Prompt / output length smoothing, in requests: the last ~50 finished.
_LENGTH_ALPHA = 0.02


@dataclass
class ModelDemand:
    """One model's demand: rates in requests per second, per class."""

    fast: list[float] = field(default_factory=lambda: [0.0] * NUM_CLASSES)
    slow: list[float] = field(default_factory=lambda: [0.0] * NUM_CLASSES)
    prompt_tokens: float = 0.0      # mean, arrivals
    output_tokens: float = 0.0      # mean, finished requests (0 = none finished yet)
    max_tokens: float = 0.0         # mean max_tokens asked, arrivals (output bound before any finished)
    cached_fraction: float = 0.0    # of prompt tokens, finished requests
    # Counted since the last roll.
    arrived: list[int] = field(default_factory=lambda: [0] * NUM_CLASSES)

    def rate(self) -> float:
        """Requests per second, all classes: the faster-rising of the two."""
        return max(sum(self.fast), sum(self.slow))

    def shares(self) -> list[float]:
        """Each class's share of the arrivals (equal shares before any)."""
        per_class = [max(f, s) for f, s in zip(self.fast, self.slow, strict=True)]
        total = sum(per_class)
        return [r / total for r in per_class] if total > 0 else [1.0 / NUM_CLASSES] * NUM_CLASSES

    def output(self) -> float:
        """Mean output tokens: as measured, else the mean max_tokens asked."""
        return self.output_tokens if self.output_tokens > 0 else self.max_tokens


class DemandMeter:
    def __init__(self, fast_seconds: float, slow_seconds: float, now: float) -> None:
        self._fast = fast_seconds
        self._slow = slow_seconds
        self._rolled = now
        self._models: dict[str, ModelDemand] = {}

    def get(self, model: str) -> ModelDemand:
        demand = self._models.get(model)
        if demand is None:
            demand = self._models[model] = ModelDemand()
        return demand

    def models(self) -> Collection[str]:
        return self._models.keys()

    def arrived(self, model: str, cls: int, prompt_tokens: int, max_tokens: int) -> None:
        d = self.get(model)
        d.arrived[cls] += 1
        first = d.prompt_tokens == 0 and d.max_tokens == 0
        a = 1.0 if first else _LENGTH_ALPHA
        d.prompt_tokens += a * (prompt_tokens - d.prompt_tokens)
        d.max_tokens += a * (max_tokens - d.max_tokens)

    def finished(self, model: str, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> None:
        """A request's usage (RequestDone); one with no tokens (withdrawn
        before any) says nothing about lengths."""
        if completion_tokens <= 0:
            return
        d = self.get(model)
        a = 1.0 if d.output_tokens == 0 else _LENGTH_ALPHA
        d.output_tokens += a * (completion_tokens - d.output_tokens)
        cached = min(1.0, cached_tokens / prompt_tokens) if prompt_tokens > 0 else 0.0
        d.cached_fraction += a * (cached - d.cached_fraction)

    def roll(self, now: float) -> None:
        """Fold the counts since the last roll into the rates."""
        dt = now - self._rolled
        if dt <= 0:
            return
        self._rolled = now
        fast, slow = 1.0 - math.exp(-dt / self._fast), 1.0 - math.exp(-dt / self._slow)
        for d in self._models.values():
            for cls in range(NUM_CLASSES):
                r = d.arrived[cls] / dt
                d.fast[cls] += fast * (r - d.fast[cls])
                d.slow[cls] += slow * (r - d.slow[cls])
                d.arrived[cls] = 0
