"""The aging rule: how long a request waits in a class before it moves up.

A request admitted in class c at time t reaches class c-1 at
t + threshold[c], class c-2 threshold[c-1] seconds later, and so on up to P0.
The rule is a pure function of (admitted class, arrival, now), so the queue
can apply it from an injected clock and tests can check it on a fake one.
Promotion times depend only on arrival, never on when the queue happened to
look, so no request starves however rarely the queue is polled.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.common.config import AgingConfig

from .records import NUM_CLASSES

__all__ = ["AgingRule"]


@dataclass(frozen=True)
class AgingRule:
    """thresholds[c] = seconds spent in class c before moving to c-1
    (thresholds[0] is unused: P0 is the top)."""

    thresholds: tuple[float, ...]

    @classmethod
    def from_config(cls, config: AgingConfig) -> AgingRule:
        return cls((0.0, config.p1_seconds, config.p2_seconds))

    def __post_init__(self) -> None:
        if len(self.thresholds) != NUM_CLASSES:
            raise ValueError(f"need {NUM_CLASSES} thresholds, got {len(self.thresholds)}")

    def class_at(self, base_class: int, arrival: float, now: float) -> int:
        """The class a request admitted in `base_class` at `arrival` waits in
        at `now`."""
        cls, moves_at = base_class, arrival
        while cls > 0:
            moves_at += self.thresholds[cls]
            if now < moves_at:
                break
            cls -= 1
        return cls

    def next_promotion(self, base_class: int, arrival: float, cls: int) -> float | None:
        """When a request now in `cls` moves up again; None once in P0."""
        if cls <= 0:
            return None
        at = arrival
        for c in range(base_class, cls - 1, -1):
            at += self.thresholds[c]
        return at
