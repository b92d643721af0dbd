"""The supply side of one model at a decision, read from the scheduler's own
books: its engines (how many serve, their KV use, their measured step speed
turned into an engine profile for the planning arithmetic) and its queue
(how many wait per class, the oldest wait, the predicted time to clear).

The engine profile: services/planning's `EngineProfile` has the shape of
the engines' own step fit (engine/step_speed.py), but a load report carries
the fit's value at the engine's batch now (`step_seconds`) and its prefill
speed, not every coefficient. So the config's profile gives the shape
(fixed vs per-sequence vs per-context cost) and the engines' reports the
scale: each decode cost x (measured step / the profile's step at that
engine's batch and context), the prefill cost = 1 / the measured prefill
speed. A vLLM engine and a sim engine are read the same way.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from dataclasses import dataclass

from services.planning.engine_model import EngineProfile
from services.scheduler.engine_registry import EngineRecord
from services.scheduler.queue import ModelQueue
from services.scheduler.records import NUM_CLASSES

__all__ = ["ModelSupply", "QueueSignal", "calibrated_profile", "clear_seconds", "queue_signal", "supply"]


@dataclass(frozen=True)
class QueueSignal:
    queued: list[int]              # per class (the class each request waits in now)
    oldest_wait: list[float]       # seconds, per class (0 = none queued)

    @property
    def total(self) -> int:
        return sum(self.queued)


@dataclass(frozen=True)
class ModelSupply:
    engines: int                 # registered, not draining (what the actuator has running)
    serving: int                 # of those, serving with a fresh report
    kv_use: float                # mean used / total blocks over the serving ones (0 = none)
    service_seconds: float       # mean measured lease duration (0 = none measured)
    max_running: int             # mean batch cap (0 = unknown)
    profile: EngineProfile | None


def queue_signal(queue: ModelQueue | None, now: float) -> QueueSignal:
    """Per class: how many wait, and the oldest wait. O(queued log queued);
    run once per decision, not per request."""
    queued, oldest = [0] * NUM_CLASSES, [0.0] * NUM_CLASSES
    if queue is None:
        return QueueSignal(queued, oldest)
    for cls in range(NUM_CLASSES):
        queued[cls] = queue.class_len(cls)
        if queued[cls]:
            arrivals = [e.arrival for _, entries in queue.classes[cls].tenant_entries() for e in entries]
            oldest[cls] = max(0.0, now - min(arrivals)) if arrivals else 0.0
    return QueueSignal(queued, oldest)


def supply(records: Iterable[EngineRecord], model: str, base: EngineProfile, context: float, now: float,
           stale_seconds: float, drained: set[str]) -> ModelSupply:
    mine = [e for e in records if e.info.model == model and not e.draining and e.engine_id not in drained]
    serving = [e for e in mine if e.load.serving and e.fresh(now, stale_seconds)]
    kv = [e.load.blocks_used / e.blocks_total() for e in serving if e.blocks_total()]
    service = [e.service_seconds for e in serving]
    caps = [e.info.max_running for e in serving if e.info.max_running > 0]
    return ModelSupply(
        engines=len(mine), serving=len(serving), kv_use=sum(kv) / len(kv) if kv else 0.0,
        service_seconds=sum(service) / len(service) if service else 0.0,
        max_running=round(sum(caps) / len(caps)) if caps else 0,
        profile=calibrated_profile(base, serving, context) if serving else None)


def calibrated_profile(base: EngineProfile, serving: list[EngineRecord], context: float) -> EngineProfile:
    """`base`'s shape at the serving engines' measured speed (module docstring)."""
    ratios, prefill = [], []
    for e in serving:
        modelled = base.fixed_seconds + e.load.running * (
            base.per_sequence_seconds + base.per_kilotoken_seconds * context / 1000.0)
        if e.load.step_seconds > 0 and modelled > 0:
            ratios.append(e.load.step_seconds / modelled)
        if e.load.prefill_tokens_per_second > 0:
            prefill.append(1.0 / e.load.prefill_tokens_per_second)
    k = sum(ratios) / len(ratios) if ratios else 1.0
    caps = [e.info.max_running for e in serving if e.info.max_running > 0]
    kv = [e.blocks_total() * e.info.block_size for e in serving if e.blocks_total()]
    return dataclasses.replace(
        base, name=f"{base.name}, measured x{k:.2f}" if ratios else base.name,
        fixed_seconds=base.fixed_seconds * k, per_sequence_seconds=base.per_sequence_seconds * k,
        per_kilotoken_seconds=base.per_kilotoken_seconds * k,
        per_prefill_token_seconds=sum(prefill) / len(prefill) if prefill else base.per_prefill_token_seconds,
        max_running=min(caps) if caps else base.max_running,
        kv_tokens=min(kv) if kv else base.kv_tokens)


def clear_seconds(queued: int, engines: int, max_running: int, service_seconds: float) -> float:
    """Little's law for the backlog: `queued` requests leave at the fleet's
    throughput (engines x batch cap / service time)."""
    if queued <= 0:
        return 0.0
    if engines <= 0 or max_running <= 0 or service_seconds <= 0:
        return math.inf
    return queued * service_seconds / (engines * max_running)
