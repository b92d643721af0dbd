"""`kvmesh bench --workload mixed_priority` at 2x and 4x overload, per class
(BENCHMARKS.md, "Mixed priorities under overload").

Starts a mesh in-process -- scheduler, `--engines` sim engines calibrated as
Meta-Llama-3-8B on an A100 (config/sim-profiles/), slowed `--speed-factor`
times so two shared cores stay ahead of the simulated GPUs, a gateway and
Envoy on free loopback ports -- then, all through Envoy with `kvmesh bench`'s
own generator and client (services/bench/):

 1. capacity: the mixed_priority workload in closed loop with twice as many
    requests in flight as the mesh has lease slots (every slot busy, a queue
    behind), `--capacity-requests` requests: completed requests per second;
 2. for each `--overloads` factor (2 and 4): Poisson arrivals at factor x
    capacity for `--seconds` s (P0/P1/P2 = `--priority-mix`), every request
    waited for (the backlog drains after the arrivals stop), with the
    scheduler's GetState read before and after (`kvmesh bench --scheduler`):
    preemptions, re-queues and seconds lost per class, when the scheduler
    reports them.

Overload means offered arrivals / what the mesh completes flat out: at 2x
half of the requests, at 4x three quarters, are beyond capacity; they queue
(aging lifts a waiting P2 to P1 after 30 s and to P0 after 60 s) or are
refused at the caps. TTFT is wall time; "simulated" divides it by the speed
factor (every simulated cost was multiplied by it; the mesh's own overhead,
a few ms, is divided too). Prints one table ready for BENCHMARKS.md, and
`kvmesh bench`'s own per-class summaries; `--json` writes everything.

    .venv/bin/python scripts/bench_priorities.py                   # ~6 min on 2 cores
    .venv/bin/python scripts/bench_priorities.py --overloads 2 --seconds 15

Bounded: each phase ends by itself (requests time out after
`--request-timeout` s), the mesh is stopped on exit or failure, loopback
only. Not a test: it measures.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scenario_preemption import apply_override, write_json

from services.bench.cli import bench, token_counter
from services.bench.report import format_summary
from services.bench.runner import Target, run_workload
from services.bench.workloads import Arrival, ArrivalSpec, WorkloadKind, WorkloadSpec, build_workload
from services.common.config import MeshConfig, load_config
from services.engine.sim.profiles import apply_profile, load_profile
from services.launcher.mesh import Mesh, MeshOptions, start_on_free_ports

MODEL = "tiny-llama"


@contextmanager
def sim_mesh(config: MeshConfig, engines: int, prefix: str) -> Iterator[Mesh]:
    """The benchmarks' mesh: `engines` sim engines serving MODEL on free
    loopback ports, in a scratch run directory; stopped on the way out."""
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        print(f"starting a mesh: {engines} sim engines ...", file=sys.stderr, flush=True)
        mesh = start_on_free_ports(config, MeshOptions(engines=engines, backend="sim", model=MODEL,
                                                       free_ports=True, run_dir=Path(tmp)))
        try:
            yield mesh
        finally:
            mesh.stop_all()


def add_run_args(p: argparse.ArgumentParser, request_timeout: float) -> None:
    """The options of a run on `sim_mesh` this script shares with check_plan.py."""
    p.add_argument("--request-timeout", type=float, default=request_timeout)
    p.add_argument("--set", action="append", metavar="SECTION.FIELD=VALUE", help="config override (repeat)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", help="write every figure here")


def mesh_config(args: argparse.Namespace) -> MeshConfig:
    config = load_config(ROOT / "config" / "kvmesh.yaml")
    apply_profile(config, load_profile(args.profile), speed_factor=args.speed_factor)
    t = config.engines.template
    t.total_blocks = args.total_blocks or t.total_blocks
    t.max_running = args.max_running or t.max_running
    for model in config.models:  # long shared contexts: past tiny-llama's 2048 positions
        if model.name == MODEL:
            model.max_model_len = 16384
    config.scheduler.metrics_port = 0
    config.gateway.metrics_port = 0
    config.gateway.max_generation_seconds = 600.0
    for item in args.set or ():
        apply_override(config, item)
    return config


def lease_slots(config: MeshConfig) -> int:
    return config.engines.count * (config.engines.template.max_running + config.scheduler.engine_queue_slack)


def spec_of(args: argparse.Namespace, salt: str, requests: int) -> WorkloadSpec:
    mix = tuple(float(x) for x in args.priority_mix.split(","))
    return WorkloadSpec(WorkloadKind.MIXED_PRIORITY, conversations=requests, seed=args.seed, groups=args.groups,
                        context_tokens=args.context_tokens, max_tokens=args.max_tokens, priority_mix=mix,
                        salt=salt)


def warm(spec: WorkloadSpec, arrival: ArrivalSpec, target: Target, count: Any) -> None:
    """One unmeasured request per group first, so each run is steady state
    (the groups' contexts cached), not its cold prefills."""
    firsts: dict[int, Any] = {}
    for conv in build_workload(spec, arrival, count):
        firsts.setdefault(conv.group, conv)
    run = asyncio.run(run_workload(list(firsts.values()), ArrivalSpec(Arrival.CLOSED, concurrency=len(firsts)),
                                   target))
    failed = [r.error for r in run.results if not r.ok]
    if failed:
        raise RuntimeError(f"warm-up failed: {failed[:3]}")


def measure(label: str, spec: WorkloadSpec, arrival: ArrivalSpec, target: Target, count: Any,
            scheduler: str) -> dict[str, Any]:
    warm(spec, arrival, target, count)
    started = time.monotonic()
    _, summary = asyncio.run(bench(spec, arrival, target, count, label=label, scheduler=scheduler))
    summary["label"] = label
    print(f"\n{label} ({time.monotonic() - started:.0f} s)\n{format_summary(summary)}", file=sys.stderr, flush=True)
    return summary


def _ms(block: dict[str, Any], p: str, divide: float = 1.0) -> str:
    v = block["ttft_s"].get(p)
    return "-" if v is None else f"{v * 1000 / divide:.0f}"


def table(runs: list[dict[str, Any]], speed: float) -> str:
    head = ["load", "class", "ok / sent", "rejected", "TTFT p50 / p99 wall ms", "simulated p50 / p99 ms",
            "req/s", "preempted / requeued / s lost"]
    rows = [head, ["---"] * len(head)]
    for run in runs:
        figures = run.get("scheduler_classes") or {}
        for name, b in run["classes"].items():
            c = figures.get(name)
            pre = "-" if c is None else f"{c['preemptions']:.0f} / {c['requeued']:.0f} / {c['seconds_lost']:.1f}"
            rows.append([run["load"], name, f"{b['ok']} / {b['requests']}", str(b["rejected"]),
                         f"{_ms(b, 'p50')} / {_ms(b, 'p99')}", f"{_ms(b, 'p50', speed)} / {_ms(b, 'p99', speed)}",
                         f"{b['requests_per_s']:.2f}", pre])
    return "\n".join("| " + " | ".join(r) + " |" for r in rows)


def not_served(runs: list[dict[str, Any]]) -> str:
    """What each refused or failed request was told, by load and class."""
    lines = [f"{run['load']} {name} {what} {count}x: {reason}"
             for run in runs for name, b in run["classes"].items()
             for what in ("rejected", "failed")
             for reason, count in b.get("rejections" if what == "rejected" else "errors", {}).items()]
    return "\n".join(lines) if lines else "every request was served"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engines", type=int, default=2)
    p.add_argument("--profile", default=str(ROOT / "config" / "sim-profiles" / "llama3-8b-a100.yaml"))
    p.add_argument("--speed-factor", type=float, default=4.0)
    p.add_argument("--total-blocks", type=int, default=640, help="KV blocks per engine (0 = the profile's)")
    p.add_argument("--max-running", type=int, default=8, help="batch slots per engine (0 = the profile's)")
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--context-tokens", type=int, default=2000)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--priority-mix", default="0.2,0.3,0.5", help="P0,P1,P2 fractions")
    p.add_argument("--capacity-requests", type=int, default=160)
    p.add_argument("--overloads", type=float, nargs="+", default=[2.0, 4.0])
    p.add_argument("--seconds", type=float, default=30.0, help="seconds of arrivals per overload run")
    add_run_args(p, request_timeout=900.0)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    count = token_counter(str(ROOT / ".models" / MODEL))
    runs: list[dict[str, Any]] = []
    with sim_mesh(mesh_config(args), args.engines, "kvmesh-priorities-") as mesh:
        target = Target(mesh.endpoints.public_http, MODEL, mesh.api_key, timeout_seconds=args.request_timeout)
        scheduler = mesh.endpoints.scheduler
        closed = ArrivalSpec(Arrival.CLOSED, concurrency=2 * lease_slots(mesh.config))
        cap = measure("capacity (closed loop)", spec_of(args, "[capacity] ", args.capacity_requests), closed,
                      target, count, scheduler)
        capacity = cap["overall"]["requests_per_s"]
        cap["load"] = f"closed loop, {closed.concurrency} in flight"
        runs.append(cap)
        for factor in args.overloads:
            rate = factor * capacity
            n = max(1, math.ceil(rate * args.seconds))
            run = measure(f"{factor:g}x overload: Poisson {rate:.2f}/s, {n} requests",
                          spec_of(args, f"[{factor:g}x] ", n), ArrivalSpec(Arrival.POISSON, rate=rate),
                          target, count, scheduler)
            run["load"] = f"{factor:g}x ({rate:.2f}/s)"
            runs.append(run)
    print(f"\n{args.engines} sim engines ({Path(args.profile).stem}, speed {args.speed_factor:g}, max_running "
          f"{args.max_running}, {args.total_blocks} blocks); mixed_priority: {args.groups} groups x "
          f"{args.context_tokens}-token contexts, max_tokens {args.max_tokens}, mix {args.priority_mix}; "
          f"capacity {capacity:.2f} req/s; {args.seconds:g} s of arrivals per overload; seed {args.seed}")
    print(table(runs, args.speed_factor))
    print(not_served(runs))
    write_json(args.json, {"args": vars(args), "capacity_rps": capacity, "runs": runs})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
