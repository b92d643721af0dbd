"""The scaling policy, pure: from one model's demand and supply, the engines
it needs (`need`), and from that need over time, the count to publish
(`Stepper`: hysteresis and a bound on steps).

`need` is the largest of three answers, and says which one decided:

- steady state: the fewest engines at which every class meets its
  first-token target at the quantile (services/planning: Little's law for
  each engine's batch at its share of the rate, Erlang C split by priority
  class for the queue on top), at the measured rate, lengths and cache
  share, over the engine profile calibrated from the engines' step fits
  (signals.py). A target no fleet meets (below a prefill) falls back to the
  fleet that keeps up at all;
- reactive: one engine more than serve now when the queue already misses
  -- the oldest queued P0/P1 request waited `queue_wait_share` of its
  target, or its predicted first token (its wait so far + the backlog's
  clearing time by Little's law) passes the target -- or when the serving
  engines' mean KV use passes `kv_pressure`;
- demand: a model with queued work or arrivals needs at least one engine
  (scale from zero).

`Stepper` publishes: out at once, at most `max_step_up` per decision; in
only after the need stayed below the published count for
`scale_in_hold_seconds` with no queue miss meanwhile (engines still
starting are invisible to the scheduler: a miss while they start must not
send the serving ones away), then `max_step_down` per decision; always
within [min_engines, max_engines].
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from services.common.config import ScalingConfig
from services.planning.engine_model import Workload
from services.planning.fleet_plan import ClassTarget, Targets, evaluate, smallest_fleet

from .demand import ModelDemand
from .signals import ModelSupply, QueueSignal, clear_seconds

__all__ = ["Need", "Stepper", "need"]

_CLASS_NAMES = ("P0", "P1", "P2")
# Classes whose queue wait triggers a reactive step: P2 is offline work.
_REACTIVE_CLASSES = (0, 1)


@dataclass(frozen=True)
class Need:
    engines: int
    reason: str
    # The queue misses its target now: never scale in (the engines that
    # would relieve it may still be starting, unseen by the scheduler).
    missing: bool = False


def steady(demand: ModelDemand, supply: ModelSupply, config: ScalingConfig, preempting: frozenset[int]) -> Need:
    """The planning arithmetic at the measured load (module docstring)."""
    rate = demand.rate()
    if rate <= 0 or supply.profile is None:
        return Need(0, "no load measured")
    workload = Workload(rate, demand.prompt_tokens, max(1.0, demand.output()), demand.cached_fraction)
    shares = demand.shares()
    classes = [ClassTarget(_CLASS_NAMES[c], shares[c], config.ttft_targets_seconds[c], c in preempting)
               for c in range(len(shares)) if shares[c] > 0]
    targets = Targets(classes, config.quantile, min_spares=0)
    # Searched only when max_engines can do it: the search's cost grows with
    # the fleet it tries (Erlang C over every batch slot), and it runs on
    # the scheduler's one thread.
    top = max(1, config.max_engines)
    if evaluate(supply.profile, workload, targets, top).met:
        option = smallest_fleet(supply.profile, workload, targets)
        if option is not None:
            return Need(option.engines, f"steady state: {rate:.2f} req/s, batch {option.load.batch:.1f}/engine, "
                                        f"TTFT targets met at p{100 * config.quantile:g}")
    loose = Targets([dataclasses.replace(c, ttft_seconds=math.inf) for c in classes], config.quantile, min_spares=0)
    option = smallest_fleet(supply.profile, workload, loose) if evaluate(
        supply.profile, workload, loose, top).met else None
    engines = option.engines if option is not None else top
    return Need(engines, f"steady state: {rate:.2f} req/s needs {engines} to keep up (TTFT targets out of reach "
                         f"within {top} engines)")


def reactive(queue: QueueSignal, supply: ModelSupply, config: ScalingConfig) -> Need:
    """One over the serving engines when the queue misses or KV is short."""
    for cls in _REACTIVE_CLASSES:
        target = config.ttft_targets_seconds[cls]
        if not queue.queued[cls]:
            continue
        waited = queue.oldest_wait[cls]
        ahead = sum(queue.queued[:cls + 1])
        predicted = waited + clear_seconds(ahead, supply.serving, supply.max_running, supply.service_seconds)
        if waited >= config.queue_wait_share * target or predicted > target:
            return Need(supply.serving + 1, f"queue: P{cls} waited {waited:.2f} s, first token predicted at "
                                            f"{predicted:.2f} s > {target:g} s target", missing=True)
    if supply.serving and supply.kv_use > config.kv_pressure:
        return Need(supply.serving + 1, f"KV pressure: {100 * supply.kv_use:.0f}% used > "
                                        f"{100 * config.kv_pressure:.0f}%")
    return Need(0, "")


def need(demand: ModelDemand, supply: ModelSupply, queue: QueueSignal, config: ScalingConfig,
         preempting: frozenset[int] = frozenset({0})) -> Need:
    """The engines the model needs now, before hysteresis and bounds."""
    best = steady(demand, supply, config, preempting)
    react = reactive(queue, supply, config)
    if react.engines > best.engines:
        best = react
    elif react.missing:
        best = dataclasses.replace(best, missing=True)
    if best.engines < 1 and (queue.total or demand.rate() > 0):
        best = Need(1, f"demand: {queue.total} queued with no engine" if queue.total
                    else f"demand: {demand.rate():.2f} req/s")
    return best


@dataclass
class Stepper:
    """One model's published count and the hold on scaling in."""

    desired: int | None = None      # None until the first decision
    below_since: float | None = None

    def step(self, wanted: Need, current: int, config: ScalingConfig, now: float) -> tuple[int, str]:
        lo, hi = config.min_engines, config.max_engines
        target = min(hi, max(lo, wanted.engines))
        if self.desired is None:
            self.desired = min(hi, max(lo, current))   # start from the fleet as it is
        if target > self.desired:
            self.below_since = None
            step = min(target, self.desired + config.max_step_up)
            reason = wanted.reason + ("" if step == target else f" (+{config.max_step_up} per decision)")
            self.desired = step
            return step, reason
        if target == self.desired or wanted.missing:
            self.below_since = None
            return self.desired, wanted.reason or "steady"
        if self.below_since is None:
            self.below_since = now
        held = now - self.below_since
        if held < config.scale_in_hold_seconds:
            return self.desired, (f"holding: {target} would do ({wanted.reason or 'idle'}); in after "
                                  f"{config.scale_in_hold_seconds - held:.0f} s more")
        self.desired = max(target, self.desired - config.max_step_down)
        return self.desired, f"scaling in towards {target} ({wanted.reason or 'idle'})"
