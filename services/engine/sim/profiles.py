"""Sim profiles: the simulator's cost model for one named model on one GPU,
with its source, kept as YAML under config/sim-profiles/.

A profile file has
  name, model, gpu, source      what it models and where every figure comes from
  engine:                       block_size, total_blocks, max_running per engine
  sim:                          SimCostConfig fields (services/common/config/engines.py)
  reference:                    the source's own step times, {tokens: ms}: one
                                forward pass over that many tokens
`check_profile` compares the sim's predicted step times with the reference
(scripts/calibrate_sim.py --check; tests/unit/bench/test_sim_profile.py).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

import yaml

from services.common.config import ConfigError, MeshConfig, SimCostConfig, config_from_dict
from services.engine.sim.cost_model import StepWork, step_seconds

__all__ = ["CheckRow", "SimProfile", "apply_profile", "check_profile", "load_profile"]

_ENGINE_KEYS = {"block_size", "total_blocks", "max_running"}


@dataclass(frozen=True)
class SimProfile:
    name: str
    model: str
    gpu: str
    source: str
    engine: dict[str, int]
    sim: SimCostConfig
    reference: dict[int, float]      # tokens in one forward pass -> milliseconds


@dataclass(frozen=True)
class CheckRow:
    label: str
    source_ms: float
    sim_ms: float

    @property
    def error(self) -> float:
        return self.sim_ms / self.source_ms - 1.0


def load_profile(path: str | Path) -> SimProfile:
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"{path}: cannot read sim profile: {exc}") from exc
    missing = {"name", "model", "gpu", "source", "engine", "sim", "reference"} - set(data)
    if missing:
        raise ConfigError(f"{path}: sim profile lacks {sorted(missing)}")
    engine = dict(data["engine"])
    unknown = set(engine) - _ENGINE_KEYS
    if unknown:
        raise ConfigError(f"{path}: engine: unknown keys {sorted(unknown)}; known: {sorted(_ENGINE_KEYS)}")
    sim = config_from_dict(SimCostConfig, data["sim"], f"{path}: sim")
    reference = {int(k): float(v) for k, v in data["reference"].items()}
    return SimProfile(str(data["name"]), str(data["model"]), str(data["gpu"]), str(data["source"]),
                      {k: int(v) for k, v in engine.items()}, sim, reference)


def apply_profile(config: MeshConfig, profile: SimProfile, speed_factor: float | None = None) -> None:
    """Make every engine of `config` this profile's GPU, and tell the
    scheduler its prefill speed (the queueing estimate of sticky placement)."""
    t = config.engines.template
    t.sim = dataclasses.replace(profile.sim)
    if speed_factor is not None:
        t.sim.speed_factor = speed_factor
    for key, value in profile.engine.items():
        setattr(t, key, value)
    config.scheduler.prefill_tokens_per_second = 1.0 / (
        profile.sim.prefill_seconds_per_token * max(t.sim.speed_factor, 1e-9))


def check_profile(profile: SimProfile) -> list[CheckRow]:
    """The sim's time for each reference point: a decode step of n sequences
    (n <= 128, context excluded: the source times linear layers only), a
    prefill of n tokens in chunks of `chunk_tokens` (n >= 128)."""
    cost = dataclasses.replace(profile.sim, speed_factor=1.0)
    rows = []
    for n, ms in sorted(profile.reference.items()):
        if n <= 128:
            sim = step_seconds(cost, StepWork(decode_sequences=n))
            rows.append(CheckRow(f"decode batch {n}", ms, sim * 1e3))
        if n >= 128:
            chunk = cost.chunk_tokens
            steps = math.ceil(n / chunk)
            sim = sum(step_seconds(cost, StepWork(prefill_tokens=min(chunk, n - i * chunk))) for i in range(steps))
            rows.append(CheckRow(f"prefill {n} tokens ({steps} step{'s' if steps > 1 else ''})", ms, sim * 1e3))
    return rows
