"""`kvmesh plan`: the engines and warm spares a target load needs, the batch
per engine and the expected queue wait per class, with the arithmetic shown
(seed 004's method -- Little's law for the steady state, a queue on top --
from a measured engine profile instead of guesses).

    kvmesh plan --rate 20 --prompt 1000 --output 200 --cached 0.5 \\
        --profile config/sim-profiles/llama3-8b-a100.yaml \\
        --mix P0=0.2,P1=0.5,P2=0.3 --ttft P0=0.5,P1=2,P2=20 --tpot-ms 50

The profile is a sim profile (config/sim-profiles/*.yaml: a GPU's step costs
from its published measurements) or, without --profile, the config's sim
engine template."""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from services.common.config import ConfigError, MeshConfig

from .engine_model import EngineProfile, Workload
from .fleet_plan import ClassTarget, Plan, Targets, plan_fleet
from .plan_render import render_plan

__all__ = ["add_parser", "parse_pairs", "run"]

CLASS_ORDER = ("P0", "P1", "P2", "batch")


def add_parser(sub: Any, run_with_config: Callable[[argparse.Namespace], None]) -> None:
    p = sub.add_parser("plan", help="the engines and spares a target load needs, with the arithmetic",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rate", type=float, required=True, help="requests per second, the whole fleet")
    p.add_argument("--prompt", type=float, required=True, help="mean prompt tokens")
    p.add_argument("--output", type=float, required=True, help="mean output tokens")
    p.add_argument("--cached", type=float, default=0.0,
                   help="share of a prompt's tokens found in the prefix cache when it hits (0-1)")
    p.add_argument("--hit-rate", type=float, default=1.0,
                   help="share of requests that find their prefix cached (0-1; `kvmesh bench` prints it)")
    p.add_argument("--service-cv", type=float, default=1.0,
                   help="coefficient of variation of output lengths: 1 exponential (default), 0 fixed")
    p.add_argument("--preempting", default="P0",
                   help="classes that preempt lower ones' running work (scheduler.preempt_classes; '' = none)")
    p.add_argument("--profile", metavar="YAML", help="a sim profile (default: the config's sim engine)")
    p.add_argument("--speed-factor", type=float, help="scale the profile's costs (as the sim's speed_factor)")
    p.add_argument("--mix", default="P0=0.2,P1=0.5,P2=0.3", help="share of arrivals per class")
    p.add_argument("--ttft", default="P0=0.5,P1=2,P2=20", help="TTFT target per class, seconds")
    p.add_argument("--quantile", type=float, default=0.99, help="the quantile the TTFT targets are at")
    p.add_argument("--tpot-ms", type=float, default=0.0, help="time per output token target (0 = none)")
    p.add_argument("--burst", type=float, default=1.25, help="the rate spares must cover, x --rate")
    p.add_argument("--min-spares", type=int, default=1, help="warm spares whatever the burst (default 1)")
    p.add_argument("--json", action="store_true", help="the plan as JSON")
    p.set_defaults(func=run_with_config)


def parse_pairs(text: str, what: str) -> dict[str, float]:
    """"P0=0.2,P1=0.5" -> {"P0": 0.2, "P1": 0.5}; classes in CLASS_ORDER."""
    out: dict[str, float] = {}
    for part in filter(None, (s.strip() for s in text.split(","))):
        name, sep, value = part.partition("=")
        if not sep or name not in CLASS_ORDER:
            raise ConfigError(f"{what}: {part!r} is not CLASS=VALUE with CLASS one of {', '.join(CLASS_ORDER)}")
        try:
            out[name] = float(value)
        except ValueError:
            raise ConfigError(f"{what}: {value!r} is not a number") from None
        if not math.isfinite(out[name]) or out[name] < 0:
            raise ConfigError(f"{what}: {name} must be a finite number >= 0")
    return out


def _targets(ns: argparse.Namespace) -> Targets:
    mix, ttft = parse_pairs(ns.mix, "--mix"), parse_pairs(ns.ttft, "--ttft")
    total = sum(mix.values())
    if total <= 0:
        raise ConfigError("--mix: the shares sum to 0")
    missing = set(mix) - set(ttft)
    if missing:
        raise ConfigError(f"--ttft: no target for {', '.join(sorted(missing))}")
    preempting = {x.strip() for x in ns.preempting.split(",") if x.strip()}
    unknown = preempting - set(CLASS_ORDER)
    if unknown:
        raise ConfigError(f"--preempting: unknown class {', '.join(sorted(unknown))}")
    classes = [ClassTarget(n, mix[n] / total, ttft[n], n in preempting) for n in CLASS_ORDER if mix.get(n, 0) > 0]
    if not 0.5 <= ns.quantile < 1:
        raise ConfigError("--quantile must be in [0.5, 1)")
    if ns.service_cv < 0:
        raise ConfigError("--service-cv must be >= 0")
    return Targets(classes, ns.quantile, ns.tpot_ms / 1e3, max(1.0, ns.burst), max(0, ns.min_spares), ns.service_cv)


def _profile(config: MeshConfig, ns: argparse.Namespace) -> EngineProfile:
    if ns.profile:
        from services.engine.sim.profiles import load_profile

        prof = load_profile(ns.profile)
        sim = prof.sim
        if ns.speed_factor is not None:
            sim = type(sim)(**{**asdict(sim), "speed_factor": ns.speed_factor})
        kv = prof.engine.get("total_blocks", 0) * prof.engine.get("block_size", 0)
        return EngineProfile.from_sim(f"{prof.name} ({prof.gpu})", sim, prof.engine.get("max_running", 1), kv)
    profile = EngineProfile.from_config(config)
    if ns.speed_factor is not None:
        t = config.engines.template
        sim = type(t.sim)(**{**asdict(t.sim), "speed_factor": ns.speed_factor})
        profile = EngineProfile.from_sim(profile.name, sim, profile.max_running, profile.kv_tokens)
    return profile


def _workload(ns: argparse.Namespace) -> Workload:
    if ns.rate <= 0 or ns.prompt < 0 or ns.output < 1 or not 0 <= ns.cached <= 1 or not 0 <= ns.hit_rate <= 1:
        raise ConfigError("--rate > 0, --prompt >= 0, --output >= 1, 0 <= --cached <= 1 and 0 <= --hit-rate <= 1")
    return Workload(ns.rate, ns.prompt, ns.output, ns.cached, ns.hit_rate)


def _as_json(plan: Plan) -> str:
    def option(o: Any) -> Any:
        return None if o is None else {
            "engines": o.engines, "met": o.met, "batch": o.load.batch, "step_seconds": o.load.step_seconds,
            "service_seconds": o.load.service_seconds, "p_wait": o.p_wait,
            "classes": {c.name: {"wait_seconds": c.wait_seconds, "ttft_seconds": c.ttft_seconds, "met": c.met}
                        for c in o.classes}}
    return json.dumps({"engines": plan.chosen.engines if plan.chosen else None, "spares": plan.spares,
                       "chosen": option(plan.chosen), "one_fewer": option(plan.below)}, indent=2, default=str)


def run(config: MeshConfig, ns: argparse.Namespace) -> int:
    try:
        plan = plan_fleet(_profile(config, ns), _workload(ns), _targets(ns))
    except ConfigError as exc:
        print(f"kvmesh plan: {exc}")
        return 2
    print(_as_json(plan) if ns.json else render_plan(plan), end="" if not ns.json else "\n")
    return 0 if plan.chosen is not None else 1
