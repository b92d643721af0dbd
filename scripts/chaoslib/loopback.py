"""The loopback chaos mesh: the scheduler (or `--schedulers N` active
replicas), 2 engines, 2 gateways and Envoy on free loopback ports
(`services.launcher.mesh.Mesh`), and its faults: engine-kill,
scheduler-kill, core-kill, hang, gateway-roll, gateway-kill, and with
several replicas scheduler-roll (see scripts/chaos.py; the scheduler faults
are schedulers.py's). With `--paired` the same load runs first without
faults, on the same mesh, and the two runs are compared (latency.py)."""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import random
import signal
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from services.common.affinity import descendants
from services.common.config import MeshConfig, load_config
from services.launcher.mesh import Mesh, MeshError, MeshOptions
from services.launcher.up import Restarts

from . import schedulers
from .latency import compare_lines, ttft_lines
from .outcomes import Job, Tally, Target, baseline, load, make_jobs, merged, report

ROOT = Path(__file__).resolve().parents[2]
SIM_MODEL = "tiny-llama"
FAULTS = ("engine-kill", "scheduler-kill", "core-kill", "hang", "gateway-roll", "gateway-kill")
# Only when asked for (not in the default draw), and with 2+ scheduler replicas.
REPLICA_FAULTS = ("scheduler-roll", "scheduler-stop")
_COUNTERS = ("kvmesh_gateway_migrations_total", "kvmesh_gateway_scheduler_readmissions_total",
             "kvmesh_gateway_drain_cut_total")


# ------------------------------------------------------------------ faults


def gateway_counters(mesh: Mesh, replicas: list[int]) -> dict[str, float]:
    """Migration / re-admission / drain-cut counters summed over these gateway replicas."""
    out: dict[str, float] = collections.defaultdict(float)
    for r in replicas:
        port = mesh.config.gateway.metrics_port + r
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
                text = resp.read().decode()
        except OSError:
            continue
        for line in text.splitlines():
            if line.startswith(_COUNTERS):
                series, value = line.rsplit(" ", 1)
                out[series] += float(value)
    return out


def add_gateway_counters(mesh: Mesh, tally: Tally) -> None:
    """Add every running gateway's counters to the tally's (at the end of a run)."""
    for series, value in gateway_counters(mesh, list(range(len(mesh.endpoints.gateway_http)))).items():
        tally.counters[series] += value


def _engine_core(mesh: Mesh, engine: str) -> int | None:
    """The pid of the engine's VLLM::EngineCore process, None if it has none."""
    pid = mesh.pid(engine)
    if pid is None:
        return None
    for child in descendants(pid):
        try:
            if b"EngineCore" in Path(f"/proc/{child}/cmdline").read_bytes():
                return child
        except OSError:
            continue
    return None


def _cont(pid: int) -> bool:
    """SIGCONT `pid`; False when it no longer exists."""
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        return False
    return True


class Chaos:
    """The fault loop (runs in a thread: Mesh is driven from one thread)."""

    def __init__(self, mesh: Mesh, rng: random.Random, faults: list[str], hang_seconds: float,
                 tally: Tally, every: float | None = None) -> None:
        """`every`: a fault every `every` s, the first after half of it;
        None: one every 1-3 s (drawn)."""
        self.mesh, self.rng, self.tally, self.hang_seconds = mesh, rng, tally, hang_seconds
        self.every = every
        self.engines = [n for n in mesh.names if n.startswith("engine-")]
        self.gateways = [n for n in mesh.names if n.startswith("gateway-")]
        self.vllm = mesh.config.engines.backend == "vllm"
        self.faults = list(faults)
        self.stop = threading.Event()
        self.restarts = Restarts(mesh)
        if "core-kill" in self.faults and not self.vllm:
            self.faults.remove("core-kill")
            tally.actions.append("core-kill skipped: the sim has no engine-core process, and its crash hook "
                                 "is reachable only in-process")
        self.run_fault: dict[str, Callable[[], str]] = {
            "engine-kill": self.engine_kill, "scheduler-kill": self.scheduler_kill,
            "core-kill": self.core_kill, "hang": self.hang,
            "gateway-roll": self.gateway_roll, "gateway-kill": self.gateway_kill,
            "scheduler-roll": lambda: schedulers.roll_replicas(self.mesh),
            "scheduler-stop": lambda: schedulers.stop_replica(self.mesh, self.rng, self.hang_seconds),
        }

    def _pause(self, due: float) -> float:
        """Sleep until the next fault; the one after it is due then."""
        if self.every is None:
            time.sleep(self.rng.uniform(1.0, 3.0))
            return due
        time.sleep(max(0.0, due - time.monotonic()))
        return due + self.every

    def run(self, until: float) -> None:
        start = time.monotonic()
        due = start + (self.every or 0.0) / 2
        while (due if self.every else time.monotonic()) < until - 3.0 and self.faults:
            due = self._pause(due)
            self.restarts.check()  # engines that failed over on their own come back, as under kvmesh up
            kind = self.rng.choice(self.faults)
            at = time.monotonic() - start
            try:
                what = self.run_fault[kind]()
            except MeshError as exc:    # a service that did not come back: the load goes on, the report says so
                what = f"FAILED: {exc}"
            self.tally.actions.append(f"{at:5.1f}s {kind}: {what} (+{time.monotonic() - start - at:.1f}s)")
            self.restarts.check()
        self.stop.set()

    def _keep_counters(self, names: list[str]) -> None:
        """A gateway's counters die with it: keep them."""
        for series, value in gateway_counters(self.mesh, [self.gateways.index(n) for n in names]).items():
            self.tally.counters[series] += value

    def engine_kill(self, name: str | None = None) -> str:
        name = name or self.rng.choice(self.engines)
        self.mesh.kill(name)
        time.sleep(self.rng.uniform(0.5, 2.0))
        self.mesh.restart(name)
        return f"SIGKILL {name}, restarted"

    def scheduler_kill(self) -> str:
        return schedulers.kill_replica(self.mesh, self.rng)

    def core_kill(self) -> str:
        name = self.rng.choice(self.engines)
        core = _engine_core(self.mesh, name)
        if core is None:
            return f"{name} has no EngineCore process right now; nothing done"
        os.kill(core, signal.SIGKILL)
        return f"SIGKILL {name}'s EngineCore (pid {core})"

    def hang(self, name: str | None = None) -> str:
        name = name or self.rng.choice(self.engines)
        pid = _engine_core(self.mesh, name) if self.vllm else self.mesh.pid(name)
        if pid is None:
            return f"{name}: no process to stop; nothing done"
        os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(self.hang_seconds)
        finally:
            # A vLLM engine that declared its stopped core hung has ended it
            # (and exited, to be restarted): nothing is left to continue.
            gone = not _cont(pid)
        what = "EngineCore" if self.vllm else "process"
        after = "gone by then: its engine had declared it hung" if gone else "then SIGCONT"
        return f"SIGSTOP {name}'s {what} (pid {pid}) for {self.hang_seconds:g}s, {after}"

    def gateway_roll(self) -> str:
        self._keep_counters(self.gateways)
        steps = self.mesh.rolling_restart()
        return "rolled " + ", ".join(f"{s.name} (exit {s.exit_code}, {s.seconds:.1f}s)" for s in steps)

    def gateway_kill(self, name: str | None = None) -> str:
        name = name or self.rng.choice(self.gateways)
        self._keep_counters([name])
        self.mesh.kill(name)
        time.sleep(self.rng.uniform(0.5, 2.0))
        self.mesh.restart(name)
        return f"SIGKILL {name}, restarted"

    def batch_kill(self) -> str:
        """The batch service (only in meshes that run one; the soak's): its
        restart takes its batches over and resumes their lines in flight."""
        self.mesh.kill("batch")
        time.sleep(self.rng.uniform(0.5, 2.0))
        self.mesh.restart("batch")
        return "SIGKILL batch, restarted"


# ------------------------------------------------------------------ the run


def make_mesh(ns: argparse.Namespace, tune: Callable[[MeshConfig], None] | None = None) -> tuple[Mesh, str]:
    """The mesh (not started) and its model; `tune` changes the config last."""
    config = load_config(ROOT / "config" / "kvmesh.yaml")
    config.engines.template.sim.speed_factor = ns.speed_factor
    config.engines.template.max_running = ns.max_running
    if tune is not None:
        tune(config)
    model = SIM_MODEL if ns.backend == "sim" else ""
    run_dir = Path(ns.run_dir) if ns.run_dir else Path(tempfile.mkdtemp(prefix="kvmesh-chaos-"))
    mesh = Mesh(config, MeshOptions(engines=2, backend=ns.backend, gateways=2, model=model or None,
                                    schedulers=getattr(ns, "schedulers", 1), free_ports=True, run_dir=run_dir))
    return mesh, mesh.config.engines.template.model


def _drain_cuts(mesh: Mesh) -> int:
    """Streams gateways cut at their drain bound (they log it, then exit)."""
    cuts = 0
    for path in mesh.log_dir.glob("gateway-*.log"):
        for line in path.read_text(errors="replace").splitlines():
            if "still in flight" in line and "drain:" in line:
                cuts += int(line.split("drain: ", 1)[1].split(" ", 1)[0])
    return cuts


@dataclass(frozen=True)
class _Load:
    """What both runs of a paired invocation send: the same requests, the
    same clients' seeds (so the same request order), the same length (the
    run without faults in two halves, `seconds` / 2 before and after)."""

    target: Target
    jobs: list[Job]
    expected: dict[Job, str]
    seed: float
    concurrency: int


async def _phase(mesh: Mesh, spec: _Load, chaos: Chaos | None, seconds: float) -> tuple[Tally, float]:
    """One run of the load for `seconds`, with `chaos`'s faults (None:
    without faults); the tally has the gateways' counters of this run only."""
    tally = chaos.tally if chaos is not None else Tally()
    before = gateway_counters(mesh, list(range(len(mesh.endpoints.gateway_http))))
    began = time.monotonic()
    until = began + seconds
    thread = asyncio.create_task(asyncio.to_thread(chaos.run, until)) if chaos is not None else None
    await load(spec.target, spec.jobs, spec.expected, random.Random(spec.seed), until, spec.concurrency, tally)
    if thread is not None:
        await thread
    took = time.monotonic() - began
    add_gateway_counters(mesh, tally)
    for series, value in before.items():
        tally.counters[series] -= value
    return tally, took


def _describe(mesh: Mesh, ns: argparse.Namespace) -> str:
    n = len(schedulers.replicas(mesh))
    return (f"{'scheduler' if n == 1 else f'{n} scheduler replicas'}, 2 {ns.backend} engines, 2 gateways, Envoy"
            + (f"; priorities P0/P1/P2 {ns.priority_mix}" if getattr(ns, "priority_mix", "") else ""))


_PAIRED = " (paired with the same load without faults, half before, half after)"


async def run(ns: argparse.Namespace) -> int:
    """The loopback run; its exit status (1 if anything was lost)."""
    rng = random.Random(ns.seed)
    mesh, model = make_mesh(ns)
    faults = ns.faults.split(",")
    print(f"chaos: seed {ns.seed}, {ns.seconds:.0f}s, {ns.concurrency} concurrent clients, faults "
          f"{', '.join(faults)}{_PAIRED if ns.paired else ''}; "
          f"logs in {mesh.log_dir}", flush=True)
    t0 = time.monotonic()
    mesh.start()
    base: Tally | None = None
    base_took = 0.0
    try:
        print(f"chaos: mesh up in {time.monotonic() - t0:.1f}s ({_describe(mesh, ns)})", flush=True)
        target = Target(mesh.endpoints.public_http, mesh.api_key, model)
        mix = tuple(float(x) for x in ns.priority_mix.split(",")) if ns.priority_mix else ()
        jobs = make_jobs(rng, ns.distinct, ns.max_tokens, mix)
        expected = await baseline(target, jobs)
        chaos = Chaos(mesh, random.Random(rng.random()), faults, ns.hang_seconds, Tally(), ns.every)
        spec = _Load(target, jobs, expected, rng.random(), ns.concurrency)
        if ns.paired:   # without faults before and after: drift over the run weighs on both sides alike
            first, first_took = await _phase(mesh, spec, None, ns.seconds / 2)
            print(f"chaos: the first half of the run without faults: {first_took:.1f}s", flush=True)
        tally, took = await _phase(mesh, spec, chaos, ns.seconds)
        if ns.paired:
            second, second_took = await _phase(mesh, spec, None, ns.seconds / 2)
            base, base_took = merged(first, second), first_took + second_took
    finally:
        mesh.stop_all()
    if base is not None:
        print("chaos: without faults:")
        lost = report(base, base_took, lambda: ttft_lines(base))
        print("chaos: with faults:")
    else:
        lost = 0

    def extra() -> list[str]:
        lines = [f"streams cut at a gateway's drain bound (gateway logs): {_drain_cuts(mesh)}", *ttft_lines(tally)]
        return lines + (compare_lines(base, tally) if base is not None else [])
    return max(lost, report(tally, took, extra))
