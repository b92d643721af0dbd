"""One fleet size and scheduler count end to end: the scheduler processes
(`schedulers` replicas, as `kvmesh up --schedulers N`), the synthetic engine
hosts (each engine connects and reports to every replica), the synthetic
gateways (admitting on the replicas), then the steps of offered load until
saturation, with each replica's CPU, RSS and decision histogram sampled
around each step.

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
from .scheduler_proc import SchedulerProcess, start_schedulers, stop_all
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
    # Active scheduler replicas (README "Several schedulers"); with several,
    # all of them are pinned to `scheduler_cpu` when it is set.
    schedulers: int = 1


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
    """Fresh engines the scheduler lists; 0 while it is too busy to answer in
    time (1,024 hellos on a loaded machine): the caller polls until its deadline."""
    with grpc.insecure_channel(address) as channel:
        try:
            state = scheduler_pb2_grpc.SchedulerStub(channel).GetState(scheduler_pb2.GetStateRequest(), timeout=10.0)
        except grpc.RpcError as err:
            if err.code() is not grpc.StatusCode.DEADLINE_EXCEEDED:
                raise
            return 0
    return sum(1 for e in state.engines if e.fresh)


def _addresses(scheds: list[SchedulerProcess]) -> tuple[str, ...]:
    return tuple(s.address for s in scheds)


def _start_engines(opts: FleetOptions, scheds: list[SchedulerProcess], children: _Children) -> tuple[float, float]:
    """Start the synthetic engines; the seconds until every replica saw all
    of them fresh, and the replicas' CPU meanwhile."""
    began, cpu = time.monotonic(), [sample(s.pid).cpu_s for s in scheds]
    for first in range(0, opts.engines, opts.engines_per_host):
        spec = EngineHostSpec(first, min(opts.engines_per_host, opts.engines - first), _addresses(scheds),
                              opts.workload)
        children.hosts.append(_spawn(children, host_main, spec))
    for conn in children.hosts:
        if not conn.poll(_REGISTER_SECONDS):
            raise RuntimeError("a synthetic engine host did not come up")
        conn.recv()
    deadline = time.monotonic() + _REGISTER_SECONDS
    for sched in scheds:   # every replica sees the whole fleet
        while (seen := _registered(sched.address)) < opts.engines:
            if time.monotonic() > deadline:
                raise RuntimeError(f"only {seen} of {opts.engines} engines registered at {sched.address}")
            time.sleep(0.2)
    return time.monotonic() - began, sum(sample(s.pid).cpu_s - c for s, c in zip(scheds, cpu, strict=True))


def _start_gateways(opts: FleetOptions, scheds: list[SchedulerProcess], children: _Children) -> None:
    for index in range(opts.gateways):
        spec = GatewaySpec(index, _addresses(scheds), opts.workload, opts.hold_min, opts.hold_max,
                           opts.first_token)
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


def _decisions(scheds: list[SchedulerProcess]) -> dict[float, float]:
    """The replicas' decision histograms, merged (same buckets: summed)."""
    merged: dict[float, float] = {}
    for sched in scheds:
        for bound, count in histogram_buckets(sched.metrics(), DECISION_HISTOGRAM).items():
            merged[bound] = merged.get(bound, 0.0) + count
    return merged


def _step(number: int, rate: float, opts: FleetOptions, scheds: list[SchedulerProcess],
          children: _Children) -> StepFigures:
    pids = children.pids()
    s0, d0 = [sample(s.pid) for s in scheds], sum(sample(pid).cpu_s for pid in pids)
    h0, m0, t0 = _decisions(scheds), _host_messages(children), time.monotonic()
    for conn in children.gateways:
        conn.send(StepOrder(number, rate / opts.gateways, opts.seconds))
    tally = merge_tallies([conn.recv()[1] for conn in children.gateways])
    s1, d1 = [sample(s.pid) for s in scheds], sum(sample(pid).cpu_s for pid in pids)
    h1, m1, t1 = _decisions(scheds), _host_messages(children), time.monotonic()
    hist = bucket_delta(h1, h0)
    rejected = sum(tally.rejected.values())
    late = sorted(tally.late)
    cpu = tuple(b.cpu_s - a.cpu_s for a, b in zip(s0, s1, strict=True))
    return StepFigures(
        engines=opts.engines, offered=rate, seconds=opts.seconds, sent=tally.sent, placed=len(tally.latencies),
        placed_in_window=tally.placed_in_window, rejected=rejected, unplaced=tally.unplaced,
        p50_ms=latency_percentile(tally.latencies, tally.unplaced, 50) * 1000,
        p99_ms=latency_percentile(tally.latencies, tally.unplaced, 99) * 1000,
        hist_p50_ms=bucket_quantile(hist, 0.5) * 1000, hist_p99_ms=bucket_quantile(hist, 0.99) * 1000,
        sched_cpu_s=sum(cpu), sched_waited_s=sum(b.waited_s - a.waited_s for a, b in zip(s0, s1, strict=True)),
        driver_cpu_s=d1 - d0, wall_s=t1 - t0, rss_kib=max(b.rss_kib for b in s1),
        late_p99_ms=(late[int(0.99 * (len(late) - 1))] * 1000 if late else 0.0),
        engine_messages=m1 - m0, schedulers=len(scheds), replica_cpu_s=cpu,
        replica_rss_kib=tuple(b.rss_kib for b in s1),
        replica_placed=tuple(tally.by_replica.get(s.address, 0) for s in scheds), moved=tally.moved)


def _pin(opts: FleetOptions, scheds: list[SchedulerProcess], children: _Children) -> None:
    if opts.scheduler_cpu is None:
        return
    others = os.sched_getaffinity(0) - {opts.scheduler_cpu}
    if not others:
        raise RuntimeError(f"no CPU left for the synthetic processes besides {opts.scheduler_cpu}")
    pin_threads([s.pid for s in scheds], {opts.scheduler_cpu})
    pin_threads(children.pids(), others)


def _baseline(opts: FleetOptions, scheds: list[SchedulerProcess], rss_empty: list[int],
              registered: tuple[float, float]) -> Baseline:
    """RSS with the fleet and the reports' CPU alone, over a quiet second or more."""
    before, began = [sample(s.pid) for s in scheds], time.monotonic()
    time.sleep(max(1.0, opts.settle_seconds))
    after = [sample(s.pid) for s in scheds]
    idle = sum(b.cpu_s - a.cpu_s for a, b in zip(before, after, strict=True)) / (time.monotonic() - began)
    fleet = tuple(a.rss_kib for a in after)
    return Baseline(opts.engines, sum(rss_empty) // len(rss_empty), sum(fleet) // len(fleet), idle,
                    schedulers=len(scheds), replica_rss_fleet_kib=fleet, register_seconds=registered[0],
                    register_cpu_s=registered[1])


def run_fleet(opts: FleetOptions, report: Callable[[StepFigures], Any] = print) -> tuple[Baseline, list[StepFigures]]:
    """Every step of `opts.rates` up to saturation: the first step not
    carried (its arrivals outran the placements) is the last."""
    children = _Children()
    with tempfile.TemporaryDirectory(prefix="kvmesh-cpbench-") as tmp:
        scheds = start_schedulers(opts.config, Path(tmp), opts.log_level, opts.schedulers)
        try:
            time.sleep(opts.settle_seconds)
            rss_empty = [sample(s.pid).rss_kib for s in scheds]
            registered = _start_engines(opts, scheds, children)
            _start_gateways(opts, scheds, children)
            _pin(opts, scheds, children)
            time.sleep(opts.settle_seconds)
            baseline = _baseline(opts, scheds, rss_empty, registered)
            steps: list[StepFigures] = []
            for number, rate in enumerate(opts.rates):
                figures = _step(number, rate, opts, scheds, children)
                steps.append(figures)
                report(figures)
                if not figures.carried:
                    break
            return baseline, steps
        finally:
            children.stop()
            stop_all(scheds)
            sys.stdout.flush()
