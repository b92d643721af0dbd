"""`kvmesh plan` against a run (issue 28): plan a fleet for a load, then start
fleets of the planned size and of one engine fewer and one more, run that
load through each, and print what the plan predicted beside what was
measured -- per class TTFT p99, and whether each target was met.

The fleet is sim engines with a calibrated profile (config/sim-profiles/,
Meta-Llama-3-8B on an A100), slowed `--speed-factor` times so the 2 shared
cores stay ahead of the simulated GPUs; the plan is computed from the same
profile at the same speed factor (services/planning/). The load is `kvmesh
bench`'s mixed_priority workload (shared contexts per group, a short
question, a fixed output length, P0/P1/P2 mix) as Poisson arrivals.

    .venv/bin/python scripts/check_plan.py                 # ~6 min on 2 cores
    .venv/bin/python scripts/check_plan.py --rate 5 --seconds 90

Bounded (requests time out, each mesh is stopped on exit or failure),
loopback only. Not a test: it measures.
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench_priorities import MODEL, add_run_args, measure, mesh_config, sim_mesh, spec_of
from scenario_preemption import write_json

from services.bench.cli import token_counter
from services.bench.runner import Target
from services.bench.workloads import Arrival, ArrivalSpec, build_workload
from services.common.config import SimCostConfig
from services.engine.sim.profiles import load_profile
from services.planning.engine_model import EngineProfile, Workload
from services.planning.fleet_plan import ClassTarget, FleetOption, Targets, evaluate, plan_fleet
from services.planning.plan_cli import parse_pairs
from services.planning.plan_render import render_plan

CLASSES = ("P0", "P1", "P2")


def _profile(args: argparse.Namespace) -> EngineProfile:
    prof = load_profile(args.profile)
    sim = SimCostConfig(**{**prof.sim.__dict__, "speed_factor": args.speed_factor})
    return EngineProfile.from_sim(f"{prof.name} x{args.speed_factor:g}", sim, args.max_running,
                                  args.total_blocks * prof.engine.get("block_size", 16))


def _workload(args: argparse.Namespace) -> Workload:
    """The mean prompt and its cached share, counted on the workload itself
    with the model's tokenizer (a group's context is cached after its first
    request on an engine; the question never is)."""
    count = token_counter(str(ROOT / ".models" / MODEL))
    convs = build_workload(spec_of(args, "[plan] ", 200), ArrivalSpec(Arrival.POISSON, rate=args.rate), count)
    assert count is not None
    contexts = [count(c.system) for c in convs]
    questions = [count(c.turns[0].user) for c in convs]
    context, question = sum(contexts) / len(convs), sum(questions) / len(convs)
    return Workload(args.rate, context + question, args.max_tokens, context / (context + question), args.hit_rate)


def _targets(args: argparse.Namespace) -> Targets:
    mix = [float(x) for x in args.priority_mix.split(",")]
    ttft = parse_pairs(args.ttft, "--ttft")
    # P0 preempts (the default scheduler.preempt_classes); every output is
    # max_tokens long (ignore_eos in the sim): service times barely vary.
    return Targets([ClassTarget(n, m / sum(mix), ttft[n], n == "P0")
                    for n, m in zip(CLASSES, mix, strict=True) if m > 0],
                   tpot_seconds=args.tpot_ms / 1e3, min_spares=0, service_cv=0.0)


def _row(n: int, predicted: FleetOption, measured: dict[str, Any]) -> list[str]:
    cells = [str(n), f"{predicted.load.batch:.1f}" if math.isfinite(predicted.load.batch) else "unstable"]
    for c in predicted.classes:
        block = measured["classes"].get(c.name, {})
        p99 = (block.get("ttft_s") or {}).get("p99")
        got = "-" if p99 is None else f"{p99:.2f}"
        ok = block.get("ok", 0) == block.get("requests", -1)
        met = p99 is not None and ok and p99 <= c.target_seconds
        cells.append(f"{c.ttft_seconds:.2f} / {got} ({'met' if c.met else 'missed'} / {'met' if met else 'missed'})")
    cells.append(f"{measured['overall']['requests_per_s']:.2f}")
    return cells


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rate", type=float, default=4.0, help="requests per second")
    p.add_argument("--seconds", type=float, default=60.0, help="seconds of arrivals per fleet")
    p.add_argument("--profile", default=str(ROOT / "config" / "sim-profiles" / "llama3-8b-a100.yaml"))
    p.add_argument("--speed-factor", type=float, default=10.0)
    p.add_argument("--total-blocks", type=int, default=640, help="KV blocks per engine")
    p.add_argument("--max-running", type=int, default=8, help="batch slots per engine")
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--hit-rate", type=float, default=0.86,
                   help="requests finding their context cached (what these runs' `hit rate` column showed)")
    p.add_argument("--context-tokens", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--priority-mix", default="0.2,0.3,0.5", help="P0,P1,P2 fractions")
    p.add_argument("--ttft", default="P0=0.6,P1=1.5,P2=6", help="TTFT p99 target per class, seconds")
    p.add_argument("--tpot-ms", type=float, default=0.0)
    add_run_args(p, request_timeout=600.0)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    profile, workload, targets = _profile(args), _workload(args), _targets(args)
    plan = plan_fleet(profile, workload, targets)
    print(render_plan(plan), flush=True)
    if plan.chosen is None:
        return 1
    sizes = [n for n in (plan.chosen.engines - 1, plan.chosen.engines, plan.chosen.engines + 1) if n >= 1]
    count = token_counter(str(ROOT / ".models" / MODEL))
    rows, runs = [], []
    for n in sizes:
        config = mesh_config(args)
        config.engines.count = n
        with sim_mesh(config, n, "kvmesh-check-plan-") as mesh:
            target = Target(mesh.endpoints.public_http, MODEL, mesh.api_key, timeout_seconds=args.request_timeout)
            requests = max(1, math.ceil(args.rate * args.seconds))
            run = measure(f"{n} engine(s), Poisson {args.rate:g}/s, {requests} requests",
                          spec_of(args, f"[{n}] ", requests), ArrivalSpec(Arrival.POISSON, rate=args.rate),
                          target, count, mesh.endpoints.scheduler)
        runs.append({"engines": n, **run})
        rows.append(_row(n, evaluate(profile, workload, targets, n), run))
    head = ["engines", "predicted batch / engine"] + [f"{c.name} TTFT p99 s: predicted / measured (target met?)"
                                                       for c in targets.classes] + ["completed req/s"]
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    print("\n".join("| " + " | ".join(r) + " |" for r in rows))
    write_json(args.json, {"args": vars(args), "plan_engines": plan.chosen.engines, "runs": runs})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
