"""One fleet size end to end: the scheduler process, the synthetic engine
hosts (they connect and report), the synthetic gateways, then the steps of
offered load until saturation, with the scheduler's CPU, RSS and decision
histogram sampled around each step.

Ownership: this module's caller owns every process it starts here and
stops them all before it returns (also on an error)."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import grpc

from services.common.affinity import pin_threads
from services.common.proto.kvmesh.v1 import scheduler_pb2, scheduler_pb2_grpc

from .engines import EngineHostSpec, host_main
from .figures import Baseline, StepFigures, latency_percentile
from .gateways import GatewaySpec, StepOrder, gateway_main, merge_tallies
from .procstat import sample
from .promhist import bucket_delta, bucket_quantile, histogram_buckets
from .scheduler_proc import SchedulerProcess, start_scheduler
from .workload import Workload

__all__ = ["FleetOptions", "run_fleet"]

DECISION_HISTOGRAM = "kvmesh_scheduler_decision_seconds"
_REGISTER_SECONDS = 120.0


@dataclass(frozen=True)
class FleetOptions:
    engines: int
    rates: tuple[float, ...]
    seconds: float = 5.0
    gateways: int = 2
    engines_per_host: int = 512
    hold_min: float = 0.05
    hold_max: float = 0.2
    first_token: float = 0.02
    workload: Workload = field(default_factory=Workload)
    config: str = "config/kvmesh.yaml"
    log_level: str = "INFO"
    settle_seconds: float = 2.0
    # Pin the scheduler (every thread) to this CPU and the synthetic
    # processes to the others: the scheduler gets a core of its own, as on
    # a host of its own. None = let the kernel share the cores.
    scheduler_cpu: int | None = None


@dataclass
class _Children:
    processes: list[BaseProcess] = field(default_factory=list)
    hosts: list[Connection] = field(default_factory=list)
    gateways: list[Connection] = field(default_factory=list)

    def pids(self) -> list[int]:
        return [p.pid for p in self.processes if p.pid is not None]

    def stop(self) -> None:
        for conn in [*self.hosts, *self.gateways]:
            with contextlib.suppress(OSError, EOFError, BrokenPipeError):
                conn.send("stop")
        for process in self.processes:
            process.join(10.0)
            if process.is_alive():
                process.kill()
                process.join()


def _spawn(children: _Children, target: Callable[..., None], spec: object) -> Connection:
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    process = ctx.Process(target=target, args=(spec, child), daemon=True)
    process.start()
    children.processes.append(process)
    return parent


def _registered(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        state = scheduler_pb2_grpc.SchedulerStub(channel).GetState(scheduler_pb2.GetStateRequest(), timeout=10.0)
    return sum(1 for e in state.engines if e.fresh)


def _start_engines(opts: FleetOptions, sched: SchedulerProcess, children: _Children) -> None:
    for first in range(0, opts.engines, opts.engines_per_host):
        spec = EngineHostSpec(first, min(opts.engines_per_host, opts.engines - first), (sched.address,),
                              opts.workload)
        children.hosts.append(_spawn(children, host_main, spec))
    for conn in children.hosts:
        if not conn.poll(_REGISTER_SECONDS):
            raise RuntimeError("a synthetic engine host did not come up")
        conn.recv()
    deadline = time.monotonic() + _REGISTER_SECONDS
    while _registered(sched.address) < opts.engines:
        if time.monotonic() > deadline:
            raise RuntimeError(f"only {_registered(sched.address)} of {opts.engines} engines registered")
        time.sleep(0.5)


def _start_gateways(opts: FleetOptions, sched: SchedulerProcess, children: _Children) -> None:
    for index in range(opts.gateways):
        spec = GatewaySpec(index, (sched.address,), opts.workload, opts.hold_min, opts.hold_max, opts.first_token)
        children.gateways.append(_spawn(children, gateway_main, spec))
    for conn in children.gateways:
        if not conn.poll(60.0):
            raise RuntimeError("a synthetic gateway did not come up")
        conn.recv()


def _host_messages(children: _Children) -> int:
    total = 0
    for conn in children.hosts:
        conn.send("stats")
        _, counters, _ = conn.recv()
        total += sum(counters.get(kind, 0) for kind in ("loads", "kv_events", "snapshots"))
    return total


def _step(number: int, rate: float, opts: FleetOptions, sched: SchedulerProcess, children: _Children) -> StepFigures:
    pids = children.pids()
    s0, d0 = sample(sched.pid), sum(sample(pid).cpu_s for pid in pids)
    h0, m0, t0 = histogram_buckets(sched.metrics(), DECISION_HISTOGRAM), _host_messages(children), time.monotonic()
    for conn in children.gateways:
        conn.send(StepOrder(number, rate / opts.gateways, opts.seconds))
    tally = merge_tallies([conn.recv()[1] for conn in children.gateways])
    s1, d1 = sample(sched.pid), sum(sample(pid).cpu_s for pid in pids)
    h1, m1, t1 = histogram_buckets(sched.metrics(), DECISION_HISTOGRAM), _host_messages(children), time.monotonic()
    hist = bucket_delta(h1, h0)
    rejected = sum(tally.rejected.values())
    late = sorted(tally.late)
    return StepFigures(
        engines=opts.engines, offered=rate, seconds=opts.seconds, sent=tally.sent, placed=len(tally.latencies),
        placed_in_window=tally.placed_in_window, rejected=rejected, unplaced=tally.unplaced,
        p50_ms=latency_percentile(tally.latencies, tally.unplaced, 50) * 1000,
        p99_ms=latency_percentile(tally.latencies, tally.unplaced, 99) * 1000,
        hist_p50_ms=bucket_quantile(hist, 0.5) * 1000, hist_p99_ms=bucket_quantile(hist, 0.99) * 1000,
        sched_cpu_s=s1.cpu_s - s0.cpu_s, sched_waited_s=s1.waited_s - s0.waited_s, driver_cpu_s=d1 - d0,
        wall_s=t1 - t0, rss_kib=s1.rss_kib,
        late_p99_ms=(late[int(0.99 * (len(late) - 1))] * 1000 if late else 0.0),
        engine_messages=m1 - m0)


def _pin(opts: FleetOptions, sched: SchedulerProcess, children: _Children) -> None:
    if opts.scheduler_cpu is None:
        return
    others = os.sched_getaffinity(0) - {opts.scheduler_cpu}
    if not others:
        raise RuntimeError(f"no CPU left for the synthetic processes besides {opts.scheduler_cpu}")
    pin_threads([sched.pid], {opts.scheduler_cpu})
    pin_threads(children.pids(), others)


def run_fleet(opts: FleetOptions, report: Callable[[StepFigures], Any] = print) -> tuple[Baseline, list[StepFigures]]:
    """Every step of `opts.rates` up to saturation: the first step not
    carried (its arrivals outran the placements) is the last."""
    children = _Children()
    with tempfile.TemporaryDirectory(prefix="kvmesh-cpbench-") as tmp:
        sched = start_scheduler(opts.config, Path(tmp), opts.log_level)
        try:
            time.sleep(opts.settle_seconds)
            rss_empty = sample(sched.pid).rss_kib
            _start_engines(opts, sched, children)
            _start_gateways(opts, sched, children)
            _pin(opts, sched, children)
            time.sleep(opts.settle_seconds)
            before, began = sample(sched.pid), time.monotonic()
            time.sleep(max(1.0, opts.settle_seconds))
            after = sample(sched.pid)
            baseline = Baseline(opts.engines, rss_empty, after.rss_kib,
                                (after.cpu_s - before.cpu_s) / (time.monotonic() - began))
            steps: list[StepFigures] = []
            for number, rate in enumerate(opts.rates):
                figures = _step(number, rate, opts, sched, children)
                steps.append(figures)
                report(figures)
                if not figures.carried:
                    break
            return baseline, steps
        finally:
            children.stop()
            sched.stop()
            sys.stdout.flush()
