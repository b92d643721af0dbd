"""The simulated GPU's speed at run time: a schedule and a manual override.

Every step's simulated time (cost_model.py) is multiplied by `factor(now)`:

* `engines.sim.speed_schedule` -- a list of {at_seconds, factor}: from
  `at_seconds` after the step loop started, steps cost `factor` x their
  modelled time (before the first entry: 1). A schedule ends on its last
  entry's factor (a step back to 1 is an entry like any other).
* `POST /sim/speed?factor=F` on the engine's metrics/health HTTP port
  (sim backend only; 404 on vLLM) sets F now, overriding the schedule until
  `DELETE /sim/speed`; `GET /sim/speed` says the factor in force and why.

A factor of 5 makes each step 5x longer (a GPU throttled or shared), 0.2 5x
shorter; 0 makes steps free, like `speed_factor` 0. This multiplies on top
of the static `engines.sim.speed_factor`.

Ownership: the sim backend's step loop reads it, the HTTP handler sets it;
both on the engine's one event loop.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from services.common.config.engines import SimSpeedStep

__all__ = ["SimSpeed", "SpeedNow"]


@dataclass(frozen=True)
class SpeedNow:
    factor: float
    source: str          # "schedule" | "override"
    elapsed_seconds: float


class SimSpeed:
    def __init__(self, schedule: list[SimSpeedStep], started: float) -> None:
        steps = sorted(schedule, key=lambda s: s.at_seconds)
        self._at = [s.at_seconds for s in steps]
        self._factors = [s.factor for s in steps]
        self._started = started
        self._override: float | None = None

    def begin(self, started: float) -> None:
        """The step loop starts now: the schedule counts from here."""
        self._started = started

    def factor(self, now: float) -> float:
        if self._override is not None:
            return self._override
        i = bisect.bisect_right(self._at, now - self._started)
        return self._factors[i - 1] if i else 1.0

    def set(self, factor: float) -> None:
        """Run at `factor` from now on (>= 0), whatever the schedule says."""
        if not factor >= 0 or factor == float("inf"):
            raise ValueError(f"a speed factor is a finite number >= 0, got {factor}")
        self._override = factor

    def clear(self) -> None:
        """Back to the schedule."""
        self._override = None

    def now(self, now: float) -> SpeedNow:
        return SpeedNow(self.factor(now), "override" if self._override is not None else "schedule",
                        now - self._started)
