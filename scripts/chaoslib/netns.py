"""The `--netns` chaos mesh: the namespace tests' mesh (tests/netns/mesh.py:
scheduler, 2 sim engines, 2 gateways, Envoy, a client, each a host of its
own on `NetnsHarness`'s bridge) and its faults, one at a time:

- partition: a random engine or gateway host's link is cut (no RST, no FIN:
  its peers hear silence) for a random 3-10 s, then healed; the fault ends
  when that host serves again (an engine registered fresh with the
  scheduler, a gateway healthy in Envoy's eyes);
- engine-kill / gateway-kill / scheduler-kill: SIGKILL, restarted 0.5-2 s later;
- hang: SIGSTOP of a sim engine process for `--hang-seconds`, then SIGCONT.

Clients run on the client host (an asyncio loop on a thread inside its
namespace: `run_on`); faults are made from this process's other threads.
The harness enforces its safety rules (blackhole route first, no default
route, only its own addresses in any config) and tears everything down when
the run ends, also on Ctrl-C or SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import signal
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType

from services.common.config import MeshConfig
from tests.netns.client import run_on
from tests.netns.harness import NetnsHarness, netns_unavailable
from tests.netns.mesh import API_KEY, ENGINES, GATEWAYS, HOSTS, MODEL, ROOT, NetnsMesh

from .outcomes import REQUEST_TIMEOUT_SECONDS, Tally, Target, baseline, load, make_jobs, report

FAULTS = ("partition", "engine-kill", "gateway-kill", "scheduler-kill", "hang")
# A stream with no byte for this long (4 gateway heartbeats) is resumed by its client.
STALL_SECONDS = 4.0
RECOVER_TIMEOUT = 60.0
_COUNTERS = ("kvmesh_gateway_migrations_total", "kvmesh_gateway_scheduler_readmissions_total")


def tune(ns: argparse.Namespace) -> Callable[[MeshConfig], None]:
    """The namespace tests' settings: partitions noticed within keepalive
    2 + 2 s on every hop, 1 s heartbeats (a stalled stream is told from a
    quiet one), a detached generation kept 45 s for its resuming client."""
    def apply(config: MeshConfig) -> None:
        config.engines.template.sim.speed_factor = ns.speed_factor
        config.engines.template.max_running = ns.max_running
        config.gateway.heartbeat_seconds = 1.0
        config.network.keepalive_time_seconds = config.network.keepalive_timeout_seconds = 2.0
        config.resume.grace_seconds = 45.0
    return apply


class NetnsChaos:
    """The fault loop (a thread of its own; `stop` ends it early)."""

    def __init__(self, mesh: NetnsMesh, rng: random.Random, faults: list[str], hang_seconds: float,
                 tally: Tally) -> None:
        self.mesh, self.rng, self.faults, self.hang_seconds, self.tally = mesh, rng, faults, hang_seconds, tally
        self.stop = threading.Event()
        self.partitions = 0
        self.failed = ""
        self.run_fault: dict[str, Callable[[], str]] = {
            "partition": self.partition, "engine-kill": lambda: self.kill(f"engine-{self.rng.randrange(2)}"),
            "gateway-kill": lambda: self.kill(f"gateway-{self.rng.randrange(2)}"),
            "scheduler-kill": lambda: self.kill("scheduler"), "hang": self.hang,
        }

    def run(self, until: float) -> None:
        try:
            self._loop(until)
        except Exception as exc:  # noqa: BLE001 - the load goes on; the report shows it
            self.failed = f"{type(exc).__name__}: {exc}"
            self.tally.actions.append(f"fault loop stopped: {self.failed}")

    def _loop(self, until: float) -> None:
        start = time.monotonic()
        while not self.stop.wait(self.rng.uniform(1.0, 3.0)) and time.monotonic() < until - 3.0:
            self.restart_exited()
            kind = self.rng.choice(self.faults)
            at = time.monotonic() - start
            what = self.run_fault[kind]()
            self.tally.actions.append(f"{at:5.1f}s {kind}: {what} (+{time.monotonic() - start - at:.1f}s)")

    def restart_exited(self) -> None:
        """What `kvmesh up` does for a service that exited on its own."""
        for name, code in self.mesh.exited().items():
            if name != "envoy":
                self.mesh.restart(name)
                self.tally.actions.append(f"{name} had exited ({code}): restarted")

    def _recovered(self, host: str) -> float:
        """Seconds until `host` serves again: a gateway healthy in Envoy, both
        engines fresh at the scheduler (after an engine or the scheduler came
        back). Cut short when the run stops."""
        if host in GATEWAYS:
            return self.mesh.wait_for(lambda: self.stop.is_set() or self.mesh.envoy_healthy(host),
                                      RECOVER_TIMEOUT, f"Envoy to take {host} back")
        return self.mesh.wait_for(lambda: self.stop.is_set() or self.mesh.fresh_engines() == len(ENGINES),
                                  RECOVER_TIMEOUT, "both engines fresh at the scheduler")

    def partition(self) -> str:
        host = self.rng.choice([*ENGINES, *GATEWAYS])
        seconds = self.rng.uniform(3.0, 10.0)
        self.mesh.net.cut(host)
        try:
            self.stop.wait(seconds)
        finally:
            self.mesh.net.heal(host)
        self.partitions += 1
        return f"cut {host} for {seconds:.1f}s, healed; serving again {self._recovered(host):.1f}s later"

    def keep_counters(self, replica: int) -> None:
        """A gateway's counters die with it: keep them."""
        for series in _COUNTERS:
            with contextlib.suppress(OSError):
                self.tally.counters[series] += self.mesh.gateway_counter(replica, series)

    def kill(self, name: str) -> str:
        if name.startswith("gateway-"):
            self.keep_counters(int(name[8:]))
        self.mesh.kill(name)
        self.stop.wait(self.rng.uniform(0.5, 2.0))
        self.mesh.restart(name)
        back = self._recovered(self.mesh.commands[name][0])
        return f"SIGKILL {name}, restarted, serving again {back:.1f}s later"

    def hang(self) -> str:
        name = f"engine-{self.rng.randrange(2)}"
        pid = self.mesh.procs[name].pid
        os.kill(pid, signal.SIGSTOP)
        try:
            self.stop.wait(self.hang_seconds)
        finally:
            os.kill(pid, signal.SIGCONT)
        return f"SIGSTOP {name} (pid {pid}) for {self.hang_seconds:g}s, then SIGCONT"


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def run(ns: argparse.Namespace) -> int:
    """The `--netns` run; its exit status (1 if anything was lost)."""
    why = netns_unavailable()
    if why:
        raise SystemExit(f"chaos --netns: {why} (run it as root on a machine with iproute2)")
    if not (ROOT / ".models" / MODEL).is_dir():
        raise SystemExit(f"chaos --netns: .models/{MODEL} is missing: run `make setup`")
    signal.signal(signal.SIGTERM, _interrupt)  # torn down like Ctrl-C
    rng = random.Random(ns.seed)
    faults = ns.faults.split(",")
    run_dir = Path(ns.run_dir) if ns.run_dir else Path(tempfile.mkdtemp(prefix="kvmesh-chaos-netns-"))
    print(f"chaos --netns: seed {ns.seed}, {ns.seconds:.0f}s, {ns.concurrency} concurrent clients, faults "
          f"{', '.join(faults)}; logs in {run_dir}", flush=True)
    t0 = time.monotonic()
    with NetnsHarness(HOSTS) as net:
        mesh = NetnsMesh(net, run_dir, tune(ns))
        mesh.start()
        net.assert_safe()
        print(f"chaos --netns: mesh up in {time.monotonic() - t0:.1f}s on {len(HOSTS)} hosts "
              f"({', '.join(f'{h} {a}' for h, a in net.addresses.items())})", flush=True)
        target = Target(mesh.public_http, API_KEY, MODEL, stall_seconds=STALL_SECONDS)
        jobs = make_jobs(rng, ns.distinct, ns.max_tokens)
        expected = run_on(mesh.client, lambda: baseline(target, jobs), timeout=REQUEST_TIMEOUT_SECONDS + 30)
        tally = Tally()
        chaos = NetnsChaos(mesh, random.Random(rng.random()), faults, ns.hang_seconds, tally)
        began = time.monotonic()
        until = began + ns.seconds
        thread = threading.Thread(target=chaos.run, args=(until,), name="chaos-faults", daemon=True)
        thread.start()
        running: list[tuple[asyncio.AbstractEventLoop, asyncio.Task[None]]] = []

        async def clients() -> None:
            task = asyncio.create_task(load(target, jobs, expected, random.Random(rng.random()), until,
                                            ns.concurrency, tally))
            running.append((asyncio.get_running_loop(), task))
            await task
        try:
            run_on(mesh.client, clients, timeout=ns.seconds + REQUEST_TIMEOUT_SECONDS + 60)
        finally:
            chaos.stop.set()
            for loop, task in running:  # interrupted: end the clients first (the gateways drain faster)
                with contextlib.suppress(RuntimeError):  # the loop has closed: they ended
                    loop.call_soon_threadsafe(task.cancel)
            thread.join(timeout=RECOVER_TIMEOUT + 30)
        took = time.monotonic() - began
        for replica in range(len(GATEWAYS)):
            chaos.keep_counters(replica)
        net.assert_safe()
    left = net.leftovers()
    return report(tally, took, lambda: [f"partitions made: {chaos.partitions}",
                                        f"teardown: {left if left else 'nothing left'}"])
