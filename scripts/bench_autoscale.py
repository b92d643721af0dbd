"""A ramp on a sim fleet (issue 28, "What it must show"): arrivals rising
linearly from `--from-rate` to `--to-rate` req/s over `--seconds` s
(`kvmesh bench`'s mixed_priority workload: shared contexts, P0/P1/P2 mix,
Poisson thinned to the ramp), through four fleets in turn:

  policy 1:8    `kvmesh up --autoscale 1:8`: the scheduler's scaling policy
                (services/scheduler/scaling/) and the local actuator, with
                `--spares` warm spares (scheduler.spares.count, default 1):
                engines started on top of the need, held out of placement
                and promoted when queued P0/P1 work would miss its target
  queue 1:8     the same actuator following a plain queue-depth threshold
                instead (what an HPA on queue length does): desired =
                ceil(queued / --queue-per-engine), with the same hysteresis
                (out at once within the step bound, in after the hold)
  fixed 2       two engines throughout
  fixed 8       eight engines throughout

Per fleet: P0 TTFT p99, SLO attainment per class (a request meets its SLO
when it completes with TTFT under its class's target; refused and failed
requests miss), engine-seconds (engine processes running, sampled every
0.5 s from the first request to the last answer: the cost), peak engines,
requests refused (429/503) and lost (failed otherwise). The engines are sim
engines calibrated as Meta-Llama-3-8B on an A100 (config/sim-profiles/),
slowed `--speed-factor` times so two shared cores stay ahead of the
simulated GPUs; the targets are the seeds' P0 0.5 s, P1 2 s, P2 20 s times
that factor, in wall time, and the policy is given the same targets.

    .venv/bin/python scripts/bench_autoscale.py                 # ~15 min on 2 cores
    .venv/bin/python scripts/bench_autoscale.py --fleets policy fixed8 --seconds 60

Bounded (requests time out, each mesh is stopped on exit or failure),
loopback only. Not a test: it measures.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import math
import random
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import grpc

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench_priorities import MODEL, add_run_args, mesh_config, spec_of, warm
from scenario_preemption import write_json

from services.bench.cli import token_counter
from services.bench.runner import RunResult, Target, run_workload
from services.bench.workloads import Arrival, ArrivalSpec, Conversation, WorkloadSpec, build_workload
from services.common.config import MeshConfig, ScalingConfig
from services.common.proto.kvmesh.v1 import scheduler_pb2, scheduler_pb2_grpc
from services.launcher.autoscale import EngineFigures, LocalAutoscaler, SchedulerView
from services.launcher.children import Role
from services.launcher.mesh import Mesh, MeshOptions, start_on_free_ports
from services.scheduler.scaling import Need, Stepper

FLEETS = {"policy": (1, 8), "queue": (1, 8), "fixed2": 2, "fixed8": 8}
BASE_TARGETS = (0.5, 2.0, 20.0)


def ramp(conversations: list[Conversation], r0: float, r1: float, seconds: float, seed: int) -> list[Conversation]:
    """Arrival times of a Poisson process whose rate rises linearly from r0
    to r1 over `seconds` (thinning), one per conversation, in order; the
    conversations beyond the ramp's count are dropped."""
    rng, t, times = random.Random(seed), 0.0, []
    while True:
        t += rng.expovariate(r1)
        if t > seconds:
            break
        if rng.random() <= (r0 + (r1 - r0) * t / seconds) / r1:
            times.append(t)
    return [dataclasses.replace(c, at=at) for c, at in zip(conversations, times, strict=False)]


class QueueDepth:
    """The baseline's figure: ceil(queued / per_engine), through the same
    Stepper (hysteresis and step bound) as the policy."""

    def __init__(self, view: SchedulerView, per_engine: float, config: ScalingConfig) -> None:
        self._view, self._per_engine, self._config = view, per_engine, config
        self._stepper = Stepper()
        self._channel = grpc.insecure_channel(view.address)

    def read(self) -> tuple[int | None, str, dict[str, EngineFigures]]:
        state = scheduler_pb2_grpc.SchedulerStub(self._channel).GetState(scheduler_pb2.GetStateRequest(), timeout=2)
        engines = {e.engine_id: EngineFigures(e.leases, e.running) for e in state.engines}
        current = sum(1 for e in state.engines if not e.draining)
        wanted = math.ceil(state.queued_total / self._per_engine)
        desired, reason = self._stepper.step(Need(wanted, f"{state.queued_total} queued"), current, self._config,
                                             time.monotonic())
        return desired, reason, engines

    def drain(self, engine_id: str, on: bool) -> None:
        self._view.drain(engine_id, on)

    def close(self) -> None:
        self._channel.close()
        self._view.close()


def _config(args: argparse.Namespace, fleet: str) -> MeshConfig:
    config = mesh_config(args)
    config.scheduler.spares.count = args.spares if fleet == "policy" else 0
    config.scheduler.spares.ttft_target_seconds = [t * args.speed_factor for t in BASE_TARGETS[:2]] + [0.0]
    s = config.scheduler.scaling
    s.ttft_targets_seconds = [t * args.speed_factor for t in BASE_TARGETS]
    s.interval_seconds, s.scale_in_hold_seconds = args.interval, args.hold
    return config


def _actuator(mesh: Mesh, fleet: str, args: argparse.Namespace) -> LocalAutoscaler | None:
    scaler = mesh.autoscaler()
    if scaler is not None and fleet == "queue":
        scaler.view.close()
        scaler.view = QueueDepth(SchedulerView.for_mesh(mesh.config, mesh.endpoints.scheduler, mesh.admin_token),
                                 args.queue_per_engine, mesh.config.scheduler.scaling)
    return scaler


class Meter(threading.Thread):
    """Drives the actuator (as `kvmesh up`'s supervision loop does) and
    integrates the engine processes running."""

    def __init__(self, mesh: Mesh, scaler: LocalAutoscaler | None) -> None:
        super().__init__(daemon=True)
        self.mesh, self.scaler = mesh, scaler
        self.stop = threading.Event()
        self.measuring = threading.Event()
        self.engine_seconds, self.peak = 0.0, 0
        self._names = [s.name for s in mesh.specs() if s.role is Role.ENGINE]

    def run(self) -> None:
        last = time.monotonic()
        while not self.stop.wait(0.5):
            if self.scaler is not None:
                self.scaler.check()
            now = time.monotonic()
            running = sum(self.mesh.is_running(n) for n in self._names)
            if self.measuring.is_set():
                self.engine_seconds += running * (now - last)
                self.peak = max(self.peak, running)
            last = now


def _figures(fleet: str, run: RunResult, meter: Meter, targets: list[float]) -> dict[str, Any]:
    out: dict[str, Any] = {"fleet": fleet, "engine_seconds": round(meter.engine_seconds, 1), "peak": meter.peak,
                           "seconds": round(run.duration, 1), "classes": {}}
    results = run.results
    out["refused"] = sum(r.rejected for r in results)
    out["lost"] = sum(not r.ok and not r.rejected for r in results)
    for cls, target in enumerate(targets):
        mine = [r for r in results if (r.priority or 0) == cls]
        ttfts = sorted(r.ttft for r in mine if r.ok and r.ttft is not None)
        met = sum(1 for r in mine if r.ok and r.ttft is not None and r.ttft <= target)
        p99 = ttfts[min(len(ttfts) - 1, math.ceil(0.99 * len(ttfts)) - 1)] if ttfts else None
        out["classes"][f"P{cls}"] = {"requests": len(mine), "met": met, "ttft_p99": p99, "target": target,
                                     "attainment": met / len(mine) if mine else None}
    return out


def run_fleet(fleet: str, args: argparse.Namespace, convs: list[Conversation],
              warmup: tuple[WorkloadSpec, ArrivalSpec]) -> dict[str, Any]:
    config = _config(args, fleet)
    shape = FLEETS[fleet]
    options = MeshOptions(backend="sim", model=MODEL, free_ports=True,
                          engines=shape if isinstance(shape, int) else None,
                          autoscale=shape if isinstance(shape, tuple) else None)
    with tempfile.TemporaryDirectory(prefix=f"bench-autoscale-{fleet}-") as tmp:
        print(f"[{fleet}] starting the mesh ...", file=sys.stderr, flush=True)
        mesh = start_on_free_ports(config, dataclasses.replace(options, run_dir=Path(tmp)))
        meter = Meter(mesh, _actuator(mesh, fleet, args))
        try:
            target = Target(mesh.endpoints.public_http, MODEL, mesh.api_key, timeout_seconds=args.request_timeout)
            warm(warmup[0], warmup[1], target, token_counter(str(ROOT / ".models" / MODEL)))
            meter.start()
            meter.measuring.set()
            run = asyncio.run(run_workload(convs, ArrivalSpec(Arrival.POISSON, rate=args.to_rate), target))
            meter.measuring.clear()
        finally:
            meter.stop.set()
            meter.join(timeout=10)
            if meter.scaler is not None:
                meter.scaler.close()
            mesh.stop_all()
    figures = _figures(fleet, run, meter, config.scheduler.scaling.ttft_targets_seconds)
    print(f"[{fleet}] {figures}", file=sys.stderr, flush=True)
    return figures


def table(runs: list[dict[str, Any]]) -> str:
    head = ["fleet", "P0 TTFT p99 s", "SLO met P0 / P1 / P2", "engine-s", "peak", "refused", "lost", "run s"]
    rows = [head, ["---"] * len(head)]
    for r in runs:
        c = r["classes"]
        p99 = c["P0"]["ttft_p99"]
        met = " / ".join("-" if c[k]["attainment"] is None else f"{100 * c[k]['attainment']:.0f}%" for k in c)
        rows.append([r["fleet"], "-" if p99 is None else f"{p99:.2f}", met, f"{r['engine_seconds']:.0f}",
                     str(r["peak"]), str(r["refused"]), str(r["lost"]), f"{r['seconds']:.0f}"])
    return "\n".join("| " + " | ".join(row) + " |" for row in rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--fleets", nargs="+", default=list(FLEETS), choices=list(FLEETS))
    p.add_argument("--from-rate", type=float, default=2.0)
    p.add_argument("--to-rate", type=float, default=20.0)
    p.add_argument("--seconds", type=float, default=90.0, help="seconds of the ramp")
    p.add_argument("--profile", default=str(ROOT / "config" / "sim-profiles" / "llama3-8b-a100.yaml"))
    p.add_argument("--speed-factor", type=float, default=4.0)
    p.add_argument("--total-blocks", type=int, default=640)
    p.add_argument("--max-running", type=int, default=8)
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--context-tokens", type=int, default=1000)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--priority-mix", default="0.2,0.3,0.5", help="P0,P1,P2 fractions")
    p.add_argument("--spares", type=int, default=1, help="the policy fleet's warm spares (scheduler.spares.count)")
    p.add_argument("--interval", type=float, default=5.0, help="scheduler.scaling.interval_seconds")
    p.add_argument("--hold", type=float, default=30.0, help="scheduler.scaling.scale_in_hold_seconds")
    p.add_argument("--queue-per-engine", type=float, default=4.0, help="the baseline's queued requests per engine")
    add_run_args(p, request_timeout=600.0)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    # SIGTERM (and SIGINT, which a background job ignores) ends the run
    # through the `finally` that stops the mesh: no fleet is left behind.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: sys.exit(128 + signum))
    count = token_counter(str(ROOT / ".models" / MODEL))
    total = int((args.from_rate + args.to_rate) / 2 * args.seconds * 1.5) + 50
    spec = spec_of(args, "[autoscale] ", total)
    arrival = ArrivalSpec(Arrival.POISSON, rate=args.to_rate)
    convs = ramp(build_workload(spec, arrival, count), args.from_rate, args.to_rate, args.seconds, args.seed)
    print(f"{len(convs)} requests over {args.seconds:g} s, {args.from_rate:g} -> {args.to_rate:g} req/s",
          file=sys.stderr, flush=True)
    runs = [run_fleet(fleet, args, convs, (spec, arrival)) for fleet in args.fleets]
    print(table(runs))
    if args.json:
        write_json(args.json, {"args": vars(args), "runs": runs})
    return 0


if __name__ == "__main__":
    sys.exit(main())
