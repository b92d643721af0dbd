"""The supervision loop's answer to children that exit on their own: report
each, and restart it if its `RestartPolicy` says so -- every child on its
own schedule, none waiting for another.

`Restarts.check()` is one pass, never blocking for a start: it records the
exits since the last pass, takes one health look at each child being
restarted (`started`), and starts (`respawn`) the children whose restart
is due. So an engine that dies while another one takes minutes to load its
model is restarted at once, not after it.

Rules (`RestartRules`), per child:
- backoff: a child that was healthy for `stable_seconds` or more when it
  died is restarted at once; one that dies again sooner, or whose restart
  failed (it exited before it was healthy, never became healthy within its
  start timeout, or could not be spawned), waits `backoff_first` seconds,
  then twice that each time, up to `backoff_max` -- a crash loop never spins;
- bounded attempts: at most `max_attempts` restarts in any `window_seconds`;
  the next one waits until the oldest leaves the window (said once per
  wait). A failed restart is always tried again: the bound spaces the
  attempts out, it never gives up on a child;
- one start per exit: a child that someone else started again since its
  exit (a rolling restart of the gateways, `Mesh.restart`) is running a
  process this state is not about, so its due restart is dropped -- never
  a second start that would stop (and cut) the fresh one.

Ownership: driven from the one thread that drives the mesh (`supervise` in
up.py, or a test's loop); the clock is injected for tests.
"""

from __future__ import annotations

import sys
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol, TextIO

from services.common.clock import Clock, SystemClock
from services.launcher.children import ChildExit, MeshError, RestartPolicy

__all__ = ["RestartRules", "RestartTarget", "Restarts"]


class RestartTarget(Protocol):
    """What Restarts needs of a supervisor (services/launcher/supervisor.py)."""

    def exited(self) -> list[ChildExit]: ...
    def pid(self, name: str) -> int | None: ...
    def restart_policy(self, name: str) -> RestartPolicy: ...
    def respawn(self, name: str) -> None: ...
    def started(self, name: str) -> bool: ...


@dataclass(frozen=True)
class RestartRules:
    backoff_first: float = 1.0
    backoff_max: float = 30.0
    stable_seconds: float = 60.0
    max_attempts: int = 6
    window_seconds: float = 600.0


@dataclass
class _Child:
    """One child's restart state."""

    delay: float = 0.0
    # When it last became healthy; -inf: started by the mesh, long ago enough.
    healthy_since: float | None = float("-inf")
    attempts: deque[float] = field(default_factory=deque)  # restart times within the window
    due: float | None = None  # a restart is scheduled for then
    starting: bool = False    # respawned, not healthy yet
    pid: int | None = None    # the process this state is about: the one that exited, or our restart


class Restarts:
    """Exits seen (`exits`, in order), restarts that came up healthy
    (`restarted`, names in order) and failed attempts (`failed`)."""

    def __init__(
        self,
        mesh: RestartTarget,
        rules: RestartRules | None = None,
        clock: Clock | None = None,
        out: TextIO | None = None,
    ) -> None:
        self._mesh = mesh
        self.rules = rules or RestartRules()
        self._clock = clock or SystemClock()
        self._out = out
        self._children: dict[str, _Child] = {}
        self.exits: list[ChildExit] = []
        self.restarted: list[str] = []
        self.failed: list[str] = []

    def check(self) -> None:
        """One pass: exits, then starting children, then due restarts."""
        now = self._clock.monotonic()
        for gone in self._mesh.exited():
            self._exited(gone, now)
        for name, child in list(self._children.items()):
            if child.starting:
                self._look(name, child, now)
        for name, child in list(self._children.items()):
            if child.due is not None and now >= child.due:
                if self._mesh.pid(name) != child.pid:
                    self._started_elsewhere(name, child, now)
                else:
                    self._attempt(name, child, now)

    def due(self, name: str) -> float | None:
        """When `name`'s next restart is scheduled (None: none is)."""
        child = self._children.get(name)
        return None if child is None else child.due

    # ------------------------------------------------------------ steps

    def _say(self, text: str) -> None:
        print(f"kvmesh: {text}", file=self._out or sys.stderr, flush=True)

    def _exited(self, gone: ChildExit, now: float) -> None:
        self.exits.append(gone)
        policy = self._mesh.restart_policy(gone.name)
        self._say(f"{gone.name} (pid {gone.pid}) exited unexpectedly with code {gone.returncode}; "
                  f"see {gone.log_path}. Restart policy: {policy.value}.")
        if policy is not RestartPolicy.ALWAYS:
            return
        child = self._children.setdefault(gone.name, _Child())
        child.pid = gone.pid
        if child.starting:
            self.failed.append(gone.name)
        self._schedule(gone.name, child, now)

    def _look(self, name: str, child: _Child, now: float) -> None:
        try:
            healthy = self._mesh.started(name)
        except MeshError as exc:
            self.failed.append(name)
            self._say(f"restarting {name} failed: {exc}")
            self._schedule(name, child, now)
            return
        if healthy:
            child.starting = False
            child.healthy_since = now
            self.restarted.append(name)
            self._say(f"{name} restarted")

    def _attempt(self, name: str, child: _Child, now: float) -> None:
        child.due = None
        child.attempts.append(now)
        try:
            self._mesh.respawn(name)
        except MeshError as exc:
            self.failed.append(name)
            self._say(f"restarting {name} failed: {exc}")
            child.healthy_since = None
            self._schedule(name, child, now)
            return
        child.starting = True
        child.pid = self._mesh.pid(name)

    def _started_elsewhere(self, name: str, child: _Child, now: float) -> None:
        """`name` runs a process other than the one that exited: started
        again by another hand (a rolling restart waits for its health itself)."""
        child.due = None
        child.healthy_since = now
        child.pid = self._mesh.pid(name)
        self._say(f"{name} was started again meanwhile (pid {child.pid}); its restart is not needed")

    def _schedule(self, name: str, child: _Child, now: float) -> None:
        """The child died or its restart failed: when to try next."""
        child.starting = False
        if child.due is not None:
            return  # already scheduled (its exit and a failed look, seen both)
        rules = self.rules
        if child.healthy_since is not None and now - child.healthy_since >= rules.stable_seconds:
            child.delay = 0.0  # it ran long enough: restart at once
        elif child.delay == 0.0:
            child.delay = rules.backoff_first
        else:
            child.delay = min(child.delay * 2, rules.backoff_max)
        child.healthy_since = None
        due = now + child.delay
        while child.attempts and child.attempts[0] <= now - rules.window_seconds:
            child.attempts.popleft()
        if len(child.attempts) >= rules.max_attempts:
            due = max(due, child.attempts[0] + rules.window_seconds)
            self._say(f"{name}: {len(child.attempts)} restarts in the last {rules.window_seconds:.0f} s; "
                      f"the next in {due - now:.0f} s")
        elif child.delay:
            self._say(f"{name}: restarting in {child.delay:g} s (it died soon after its last start)")
        child.due = due
