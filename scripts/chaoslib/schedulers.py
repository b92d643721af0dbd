"""Scheduler faults of the loopback chaos mesh, for one scheduler or several
active replicas (`chaos.py --schedulers N`, README "Several schedulers"):

- scheduler-kill: SIGKILL of one replica, drawn with the run's seeded RNG
  (the one scheduler when there is one), started again 0-1 s later as
  `kvmesh up` does; the fault ends once every running engine reports to it
  again (`Mesh.in_rotation`: engines reconnect within their 2 s backoff
  cap). Until then the requests it owns would wait for engines, so "healthy"
  means that, not only its gRPC health;
- scheduler-roll: a rolling restart of every replica
  (`Mesh.rolling_restart(Role.SCHEDULER)`): each in turn is SIGTERMed (it
  refuses new Admit calls and answers its queued requests DRAINING: the
  gateways re-admit them on another replica; running leases re-attach
  there), exits, is started again and has every engine reporting to it
  before the next one stops. Needs two replicas or more: the one scheduler's
  DRAINING is its clients' 503;
- scheduler-stop: SIGSTOP of one replica (drawn as for a kill) for
  `--hang-seconds`, then SIGCONT: a replica gone silent -- no reset, no FIN,
  its kernel still takes the bytes, its gRPC threads answer no keepalive
  ping -- as a host cut off is. The gateways notice its silence on their
  AdmitMany calls (`network.silent_peer_seconds`), move its requests and pass
  it over until it answers again; the fault ends once it is in rotation.
  Needs two replicas or more: with one, a stopped scheduler is a stall.
"""

from __future__ import annotations

import os
import random
import signal
import time

from services.launcher.children import MeshError, Role
from services.launcher.mesh import Mesh

__all__ = ["kill_replica", "replicas", "roll_replicas", "stop_replica", "wait_in_rotation"]

# A restarted replica has every engine back within a few seconds (Python
# start-up, then the engines' reconnect backoff, capped at 2 s); 60 s is a
# failure to report, not a slow machine.
REPLICA_TIMEOUT_SECONDS = 60.0
_POLL_SECONDS = 0.1


def replicas(mesh: Mesh) -> list[str]:
    """The mesh's scheduler children ("scheduler", "scheduler-1", ...)."""
    return [n for n in mesh.names if n == "scheduler" or n.startswith("scheduler-")]


def wait_in_rotation(mesh: Mesh, name: str, timeout: float = REPLICA_TIMEOUT_SECONDS) -> None:
    """Until `name` is in rotation again (a scheduler: every running engine
    reports to it); MeshError after `timeout` s."""
    deadline = time.monotonic() + timeout
    while not mesh.in_rotation(name):
        if time.monotonic() > deadline:
            raise MeshError(f"{name} restarted, but not every engine reported to it within {timeout:.0f} s")
        time.sleep(_POLL_SECONDS)


def kill_replica(mesh: Mesh, rng: random.Random) -> str:
    """SIGKILL a replica drawn from `rng`, start it again, wait for its engines."""
    names = replicas(mesh)
    # One scheduler: no draw, so a seed draws the same faults as before replicas.
    name = rng.choice(names) if len(names) > 1 else names[0]
    began = time.monotonic()
    mesh.kill(name)
    time.sleep(rng.uniform(0.0, 1.0))
    mesh.restart(name)
    healthy = time.monotonic() - began
    wait_in_rotation(mesh, name)
    return (f"SIGKILL {name}, healthy {healthy:.1f}s after the kill, every engine reporting to it "
            f"{time.monotonic() - began:.1f}s after")


def roll_replicas(mesh: Mesh) -> str:
    """A rolling restart of every scheduler replica (module docstring)."""
    steps = mesh.rolling_restart(Role.SCHEDULER)
    return "rolled " + ", ".join(f"{s.name} (exit {s.exit_code}, {s.seconds:.1f}s)" for s in steps)


def stop_replica(mesh: Mesh, rng: random.Random, seconds: float) -> str:
    """SIGSTOP a replica drawn from `rng` for `seconds`, SIGCONT it, wait
    until it is in rotation again."""
    name = rng.choice(replicas(mesh))
    pid = mesh.pid(name)
    if pid is None:
        return f"{name}: no process to stop; nothing done"
    os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(seconds)
    finally:
        os.kill(pid, signal.SIGCONT)
    began = time.monotonic()
    wait_in_rotation(mesh, name)
    return (f"SIGSTOP {name} (pid {pid}) for {seconds:g}s, then SIGCONT; in rotation "
            f"{time.monotonic() - began:.1f}s after")
