"""The fleet a load needs: the fewest engines at which every class meets its
first-token target at its quantile and the time per output token meets its
target, plus the warm spares that absorb a burst while a cold engine starts.

Little's law is the steady state (engine_model.py: the batch each engine
carries at its share of the rate); Erlang C with priority classes is the
queue on top of it (erlang.py). The arithmetic is kept for printing
(plan_render.py), so an operator can check it by hand."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from services.planning.engine_model import EngineLoad, EngineProfile, Workload, steady_state
from services.planning.erlang import Pool, class_wait_quantile, erlang_c

__all__ = ["ClassTarget", "FleetOption", "Plan", "Targets", "evaluate", "plan_fleet", "smallest_fleet"]

MAX_ENGINES = 4096


@dataclass(frozen=True)
class ClassTarget:
    name: str               # P0, P1, P2, batch: in priority order
    share: float            # of arrivals
    ttft_seconds: float     # first-token target at `quantile`
    preempts: bool = False  # may take a slot from lower classes' running work (scheduler.preempt_classes)


@dataclass(frozen=True)
class Targets:
    classes: list[ClassTarget]
    quantile: float = 0.99
    tpot_seconds: float = 0.0     # time per output token target (0 = none)
    burst: float = 1.25           # rate the spares must carry: burst x rate
    min_spares: int = 1           # spares whatever the burst (an engine's loss)
    service_cv: float = 1.0       # coefficient of variation of service times (output lengths)


@dataclass(frozen=True)
class ClassOutcome:
    name: str
    wait_seconds: float      # queue wait at the quantile
    ttft_seconds: float      # wait + prefill (+ half a step)
    target_seconds: float

    @property
    def met(self) -> bool:
        return self.ttft_seconds <= self.target_seconds


@dataclass(frozen=True)
class FleetOption:
    """One fleet size, everything worked out."""

    engines: int
    load: EngineLoad         # one engine at rate / engines
    slots: int               # engines x batch cap
    offered: float           # Erlangs: rate x service seconds
    p_wait: float
    classes: list[ClassOutcome]
    tpot_met: bool

    @property
    def met(self) -> bool:
        return self.load.stable and self.tpot_met and all(c.met for c in self.classes)


@dataclass(frozen=True)
class Plan:
    profile: EngineProfile
    workload: Workload
    targets: Targets
    chosen: FleetOption | None       # None: no size up to MAX_ENGINES meets the targets
    below: FleetOption | None        # one engine fewer (what it would miss)
    burst: FleetOption | None        # the fleet for burst x rate
    spares: int


def evaluate(profile: EngineProfile, workload: Workload, targets: Targets, engines: int) -> FleetOption:
    load = steady_state(profile, workload, workload.rate / engines)
    slots = engines * profile.max_running
    tpot_met = targets.tpot_seconds <= 0 or load.step_seconds <= targets.tpot_seconds
    # An overloaded engine or a missed TPOT decides it; Erlang's O(slots)
    # recursion is then not worth running (the search tries thousands of slots).
    service = load.service_seconds if load.stable and tpot_met else math.inf
    offered = workload.rate * service
    p_wait = erlang_c(slots, offered) if math.isfinite(offered) else 1.0
    shares = [c.share for c in targets.classes]
    variability = (1.0 + targets.service_cv ** 2) / 2.0
    # Unqueued, the first token at the quantile: the running step ends (up
    # to one step), then the prompt at the quantile is prefilled.
    base = load.step_seconds + load.prefill_seconds_for(workload.prefill_tokens_at(targets.quantile)) \
        if load.stable else math.inf
    outcomes = []
    for i, c in enumerate(targets.classes):
        wait = class_wait_quantile(Pool(slots, offered, service, variability), shares, i, targets.quantile,
                                   c.preempts) if math.isfinite(offered) else math.inf
        outcomes.append(ClassOutcome(c.name, wait, wait + base, c.ttft_seconds))
    return FleetOption(engines, load, slots, offered, p_wait, outcomes, tpot_met)


def smallest_fleet(profile: EngineProfile, workload: Workload, targets: Targets) -> FleetOption | None:
    """The fewest engines that meet `targets` (None: no fleet up to
    MAX_ENGINES does). The scheduler's scaling policy uses it too."""
    # Meeting the targets is monotone in the fleet size (each engine's share
    # of the rate only falls), so a doubling search then bisection finds it.
    hi = 1
    while not evaluate(profile, workload, targets, hi).met:
        hi *= 2
        if hi > MAX_ENGINES:
            return None
    lo = hi // 2  # not met (or 0)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if evaluate(profile, workload, targets, mid).met:
            hi = mid
        else:
            lo = mid
    return evaluate(profile, workload, targets, hi)


def plan_fleet(profile: EngineProfile, workload: Workload, targets: Targets) -> Plan:
    chosen = smallest_fleet(profile, workload, targets)
    below = evaluate(profile, workload, targets, chosen.engines - 1) if chosen and chosen.engines > 1 else None
    surge = dataclasses.replace(workload, rate=workload.rate * targets.burst)
    burst = smallest_fleet(profile, surge, targets)
    spares = max(targets.min_spares, burst.engines - chosen.engines) if chosen and burst else targets.min_spares
    return Plan(profile, workload, targets, chosen, below, burst, spares)
