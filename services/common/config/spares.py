"""Warm spares (`scheduler.spares`; services/scheduler/spares.py): engines of a
model that are connected, loaded, warmed and reporting, but that placement
skips until the scheduler promotes one.

Why: a vLLM engine needs 30-60 s (load + warm-up) before it serves; a spare
takes its first request as soon as the scheduler decides to use it. The
scheduler promotes a spare when the predicted first token of queued work of a
class with a target (P0, P1 by default) would miss that target, and returns
the highest-ordered idle engine to spare once its model has been calm for
`demote_hold_seconds`. Spare-ness is the scheduler's choice, not a message to
the engine: a spare still counts as serving for health and readiness.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["SparesConfig"]


@dataclass
class SparesConfig:
    """`scheduler.spares`: how many engines of each model are held as warm spares."""

    # Spares per model unless `models` names it. The scheduler never holds
    # every engine of a model: at least one serves, so 1 spare of 1 engine is
    # none. 0 = no spares (every engine serves, as before). >= 0.
    count: int = 0
    # Per-model overrides of `count`: model name -> spares. Each >= 0.
    models: dict[str, int] = field(default_factory=dict)
    # Per class [P0, P1, P2]: the time to first token (arrival -> first
    # token, seconds) a queued request of that class should meet; a spare is
    # promoted when the predicted first token of the class's queued work
    # would miss it. 0.5 s and 2 s: the articles' P0 and P1 targets. P2 0 =
    # a P2 backlog alone never promotes a spare (it waits, ages, or is the
    # autoscaler's business). Three values, each >= 0 (0 = none).
    ttft_target_seconds: list[float] = field(default_factory=lambda: [0.5, 2.0, 0.0])
    # A predicted miss must last this long before a spare is promoted. 0 =
    # at once: a P0 that would miss does not wait for a second look (the
    # spare is warm; promoting one costs nothing but its later return). >= 0.
    promote_hold_seconds: float = 0.0
    # The model must have been calm this long (nothing queued, the leases
    # of its serving engines fit in all but one of them at
    # `demote_below_utilization`) before one idle engine returns to spare;
    # the clock restarts after every promotion and demotion, so a load that
    # comes and goes within it never flaps an engine. 30 s: one aging period,
    # long against a burst, short against an hour of idle. > 0.
    demote_hold_seconds: float = 30.0
    # "Calm": leases on the serving engines <= this x the lease slots
    # (max_running) of all serving engines but the one returning. 0.5: the
    # low end of the articles' 50-70% utilisation band. 0 < x <= 1.
    demote_below_utilization: float = 0.5

    def for_model(self, model: str) -> int:
        """Spares configured for `model`."""
        return self.models.get(model, self.count)
