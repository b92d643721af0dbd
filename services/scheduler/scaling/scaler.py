"""The scaling policy wired into the scheduler: it counts demand as requests
come and go, decides every `scheduler.scaling.interval_seconds` for every
configured model (and any model requests named), and publishes

    kvmesh_scheduler_desired_engines{model}   engines wanted: serving + warm spares

-- the contract KEDA's ScaledObject reads (max over scheduler replicas,
AverageValue 1: replicas = desired) -- and, for GetState and `kvmesh top`,
one `ScalingDecision` per model (desired, current, why).

A model with no engine whose request just arrived is decided at the next
tick rather than at the next interval: scale from zero should not wait
5 s for its first engine to be asked for.

Ownership: owned by `SchedulerCore`, called only from its `handle` (the
core's one thread); it reads the fleet and the queues, never changes them.
"""

from __future__ import annotations

from collections.abc import Iterable
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

from services.common.config import MeshConfig, ScalingConfig
from services.planning.engine_model import EngineProfile

from ..engine_registry import EngineRecord
from ..metrics import SchedulerMetrics
from ..waiting import WaitingRoom
from .demand import DemandMeter
from .policy import Stepper, need
from .signals import queue_signal, supply

__all__ = ["Scaler", "ScalingDecision", "spares_for"]


@dataclass(frozen=True)
class ScalingDecision:
    """One model's published scaling figure, as GetState shows it."""

    model: str
    desired: int      # engines wanted: serving + spares (the gauge)
    current: int      # engines registered now, not draining
    spares: int       # of `desired`, warm spares
    reason: str
    autoscaled: bool  # scheduler.scaling.enabled: requests wait for an engine to start


def spares_for(config: MeshConfig, model: str) -> int:
    """Warm spares kept for `model` on top of the engines it needs (`scheduler.spares`)."""
    return config.scheduler.spares.for_model(model)


class Scaler:
    def __init__(self, config: MeshConfig, metrics: SchedulerMetrics, now: float) -> None:
        self._mesh = config
        self._config: ScalingConfig = config.scheduler.scaling
        self._stale = config.scheduler.stale_report_seconds
        self._preempting = frozenset(config.scheduler.preempt_classes)
        self._metrics = metrics
        self._base = EngineProfile.from_config(config)
        self.demand = DemandMeter(self._config.fast_rate_seconds, self._config.slow_rate_seconds, now)
        self._steppers: dict[str, Stepper] = {}
        self._models = [m.name for m in config.models]
        self._configured = frozenset(self._models)
        self._next = now + self._config.interval_seconds
        self._urgent = False
        self.decisions: dict[str, ScalingDecision] = {}

    @property
    def enabled(self) -> bool:
        return self._config.enabled

    def arrived(self, model: str, cls: int, prompt_tokens: int, max_tokens: int, served: bool) -> None:
        """A request was admitted; `served`: some engine of its model is
        registered. Only models configured or served are counted: a client
        naming models at random must not grow the books (or the gauge's series)."""
        if not served and model not in self._configured:
            return
        self.demand.arrived(model, cls, prompt_tokens, max_tokens)
        if not served:
            decided = self.decisions.get(model)
            self._urgent = self._urgent or decided is None or decided.desired == 0

    def finished(self, model: str, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> None:
        if model in self._configured or model in self.demand.models():
            self.demand.finished(model, prompt_tokens, completion_tokens, cached_tokens)

    def tick(self, engines: Iterable[EngineRecord], drained: set[str], waiting: WaitingRoom, now: float,
             spares: AbstractSet[str] = frozenset()) -> bool:
        """Decide if the interval passed (or a model with no engine waits);
        True = decided."""
        if now < self._next and not self._urgent:
            return False
        self._next, self._urgent = now + self._config.interval_seconds, False
        self.demand.roll(now)
        records = list(engines)
        for model in dict.fromkeys([*self._models, *self.demand.models()]):
            self.decisions[model] = self._decide(model, records, drained, waiting, now, spares)
        return True

    def _decide(self, model: str, records: list[EngineRecord], drained: set[str], waiting: WaitingRoom,
                now: float, spares: AbstractSet[str]) -> ScalingDecision:
        demand = self.demand.get(model)
        context = demand.prompt_tokens + demand.output() / 2.0
        undrained = [e for e in records if e.engine_id not in drained]
        have = supply(undrained, model, self._base, context, now, self._stale, spares)
        queue = queue_signal(waiting.existing_queue(model), now)
        wanted = need(demand, have, queue, self._config, self._preempting)
        stepper = self._steppers.setdefault(model, Stepper())
        serving, reason = stepper.step(wanted, have.engines, self._config, now)
        kept = spares_for(self._mesh, model) if serving else 0
        decision = ScalingDecision(model, serving + kept, have.engines, kept, reason, self._config.enabled)
        self._metrics.desired_engines.labels(model).set(decision.desired)
        return decision
