"""Child processes of one launcher: spawn, wait until healthy, watch, signal,
restart and stop.

A restart comes blocking (`restart`: start again, wait until healthy) or in
two non-blocking halves for the supervision loop (`respawn`, then `started`
once per pass until it says healthy or raises), so one slow starter (a vLLM
engine: minutes) never holds up another child's restart.

Ownership: one `Supervisor` owns its children and is driven from one thread
(the launcher's main loop or a test fixture). Each child runs in its own
session/process group, so Ctrl-C on a terminal reaches only the launcher,
which then stops the children in order (Envoy, gateways, engines, scheduler):
SIGTERM to the child's process group, a grace period, then SIGKILL. A group
is signalled only by the id of a process this object started, so helper
processes a child spawned (vLLM's engine core) go with it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from services.common.affinity import descendants, pin_threads
from services.launcher.children import (
    DEFAULT_STOP_GRACE_SECONDS,
    ChildExit,
    ChildSpec,
    MeshError,
    MeshInterrupted,
    Probe,
    RestartPolicy,
    Role,
)
from services.launcher.probes import probe_ok

__all__ = ["STOP_GRACE_SECONDS", "Supervisor"]

log = logging.getLogger("kvmesh.launcher")

ROOT = Path(__file__).resolve().parents[2]

# Seconds between SIGTERM and SIGKILL when stopping a child whose spec says
# nothing else (a gateway waits out its drain: `ChildSpec.stop_grace`).
STOP_GRACE_SECONDS = DEFAULT_STOP_GRACE_SECONDS
_POLL_SECONDS = 0.1
# Stop order: no new work first (the batch service, whose lines go through
# Envoy and the gateways; then Envoy, gateways), the scheduler last.
_STOP_RANK = {Role.BATCH: 0, Role.ENVOY: 1, Role.GATEWAY: 2, Role.ENGINE: 3, Role.SCHEDULER: 4}


@dataclass
class _Child:
    spec: ChildSpec
    log_path: Path
    process: subprocess.Popen[bytes] | None = None
    # True once we asked it to stop: its exit is then expected, not reported.
    stopping: bool = False
    reported: bool = False


@dataclass
class _Start:
    """A child on its way to healthy: the probes it has still to pass, by
    when, and the gRPC channels they use (closed when it is over)."""

    pending: list[Probe]
    deadline: float
    channels: dict[str, grpc.Channel] = field(default_factory=dict)

    def close(self) -> None:
        for channel in self.channels.values():
            channel.close()
        self.channels.clear()


class Supervisor:
    """The children started so far, by name, in first-start order. Each
    child's output goes to `log_dir/<name>.log`; a healthy child's threads go
    to `front_cores` (empty: left to the kernel)."""

    def __init__(self, log_dir: Path, cancel: threading.Event, front_cores: set[int]) -> None:
        self.log_dir = log_dir
        self.front_cores = front_cores
        self._cancel = cancel
        self._children: dict[str, _Child] = {}
        self._order: list[str] = []
        self._starts: dict[str, _Start] = {}  # respawned, not yet healthy

    # ------------------------------------------------------------ start

    def _spawn(self, spec: ChildSpec) -> None:
        child = self._children.get(spec.name) or _Child(spec, self.log_dir / f"{spec.name}.log")
        child.spec = spec
        child.stopping = False
        child.reported = False
        with open(child.log_path, "ab") as logfile:
            logfile.write(f"==== kvmesh: starting {spec.name}: {' '.join(spec.argv)}\n".encode())
            logfile.flush()
            child.process = subprocess.Popen(
                spec.argv, cwd=ROOT, env=spec.env, stdin=subprocess.DEVNULL,
                stdout=logfile, stderr=subprocess.STDOUT, start_new_session=True,
            )
        log.info("started %s (pid %d), log %s", spec.name, child.process.pid, child.log_path)
        if spec.name not in self._children:
            self._order.append(spec.name)
        self._children[spec.name] = child

    def _wait_healthy(self, child: _Child, start: _Start | None = None) -> None:
        start = start or _Start(list(child.spec.probes), time.monotonic() + child.spec.start_timeout)
        try:
            while not self._start_step(child, start):
                if self._cancel.is_set():
                    raise MeshInterrupted(f"start-up interrupted while waiting for {child.spec.name}")
                self._cancel.wait(_POLL_SECONDS)
        finally:
            start.close()

    def _start_step(self, child: _Child, start: _Start) -> bool:
        """One look at a starting child: True once every probe passed (then
        its threads are pinned); MeshError if it exited or ran out of time."""
        spec = child.spec
        while start.pending:
            proc = child.process
            if proc is None or proc.poll() is not None:
                code = None if proc is None else proc.returncode
                raise MeshError(f"{spec.name} exited with code {code} before it became healthy. "
                                + self._log_hint(child))
            if not probe_ok(start.pending[0], start.channels):
                if time.monotonic() > start.deadline:
                    raise MeshError(
                        f"{spec.name} did not become healthy within {spec.start_timeout:.0f} s "
                        f"({start.pending[0].describe()} never answered). " + self._log_hint(child)
                    )
                return False
            start.pending.pop(0)
        log.info("%s is healthy", spec.name)
        self._pin_front(child)
        return True

    def _pin_front(self, child: _Child) -> None:
        """Every thread of a healthy child on the front cores; an engine's
        children are vLLM's own processes, which the engine pinned itself."""
        if not self.front_cores or child.process is None:
            return
        pids = [child.process.pid]
        if child.spec.role is not Role.ENGINE:
            pids += descendants(child.process.pid)
        threads = pin_threads(pids, self.front_cores)
        log.info("%s: %d threads pinned to cores %s", child.spec.name, threads,
                 ",".join(map(str, sorted(self.front_cores))))

    def _log_hint(self, child: _Child, lines: int = 15) -> str:
        return f"Its log: {child.log_path}\n--- last lines ---\n{self.log_tail(child.spec.name, lines)}"

    def log_tail(self, name: str, lines: int = 20) -> str:
        child = self._children[name]
        try:
            text = child.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    # ------------------------------------------------------------ control

    @property
    def names(self) -> list[str]:
        return list(self._order)

    def pid(self, name: str) -> int | None:
        proc = self._child(name).process
        return None if proc is None else proc.pid

    def is_running(self, name: str) -> bool:
        """False also for a child never started (an engine `--autoscale` keeps for later)."""
        child = self._children.get(name)
        proc = None if child is None else child.process
        return proc is not None and proc.poll() is None

    def _child(self, name: str) -> _Child:
        try:
            return self._children[name]
        except KeyError:
            raise MeshError(f"no child named {name!r}; children: {', '.join(self._order)}") from None

    def kill(self, name: str) -> None:
        """SIGKILL a child (and its process group) at once, like a crash.
        Its exit is then expected and not reported by `exited()`."""
        child = self._child(name)
        child.stopping = True
        _signal_group(child, signal.SIGKILL)
        if child.process is not None:
            child.process.wait()

    def terminate(self, name: str) -> None:
        """SIGTERM a child without waiting (an engine then drains); its exit
        is expected and not reported by `exited()`. `wait(name)` reaps it."""
        child = self._child(name)
        child.stopping = True
        self._end_start(name)   # one stopped while it started (an engine `--autoscale` no longer wants)
        _signal_group(child, signal.SIGTERM)

    def wait(self, name: str, timeout: float) -> int | None:
        """The child's exit code once it exited, None if still running after `timeout` s."""
        proc = self._child(name).process
        if proc is None:
            return None
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def restart(self, name: str) -> None:
        """Start a child again from its spec (after it exited or was killed)
        and wait until it is healthy."""
        self.respawn(name)
        self._wait_healthy(self._children[name], self._starts.pop(name))

    def respawn(self, name: str) -> None:
        """Start a child again from its spec without waiting: `started(name)`
        says when it is healthy. A child still running is stopped first."""
        child = self._child(name)
        self._end_start(name)
        if self.is_running(name):
            self._stop([child])
        else:
            # What the exited child left in its group (a hung vLLM engine
            # core) must not hold its ports or cores.
            _signal_group(child, signal.SIGKILL)
        try:
            self._spawn(child.spec)
        except OSError as exc:
            raise MeshError(f"could not start {name}: {exc}") from exc
        self._starts[name] = _Start(list(child.spec.probes), time.monotonic() + child.spec.start_timeout)

    def launch(self, spec: ChildSpec) -> None:
        """Start a child that is not running (new, or stopped on purpose)
        without waiting: `started(name)` says when it is healthy."""
        if spec.name in self._children and self.is_running(spec.name):
            raise MeshError(f"{spec.name} is running already")
        self._end_start(spec.name)
        try:
            self._spawn(spec)
        except OSError as exc:
            raise MeshError(f"could not start {spec.name}: {exc}") from exc
        self._starts[spec.name] = _Start(list(spec.probes), time.monotonic() + spec.start_timeout)

    def started(self, name: str) -> bool:
        """One look at a respawned child: True once healthy (and from then
        on), False while it starts, MeshError if it exited first or did not
        become healthy within its start timeout (it may still be running:
        `respawn` stops it)."""
        start = self._starts.get(name)
        if start is None:
            return self.is_running(name)
        try:
            healthy = self._start_step(self._children[name], start)
        except MeshError:
            self._end_start(name)
            raise
        if healthy:
            self._end_start(name)
        return healthy

    def _end_start(self, name: str) -> None:
        start = self._starts.pop(name, None)
        if start is not None:
            start.close()

    def exited(self) -> list[ChildExit]:
        """Children that exited on their own since the last call."""
        out: list[ChildExit] = []
        for name in self._order:
            child = self._children[name]
            proc = child.process
            if proc is None or child.stopping or child.reported or proc.poll() is None:
                continue
            child.reported = True
            out.append(ChildExit(name, proc.pid, proc.returncode, child.log_path))
        return out

    def stop_grace(self, name: str) -> float:
        """SIGTERM -> SIGKILL for this child when stopped (its spec's)."""
        return self._child(name).spec.stop_grace

    def restart_policy(self, name: str) -> RestartPolicy:
        return self._child(name).spec.restart

    # ------------------------------------------------------------ stop

    def stop_all(self, grace: float | None = None) -> None:
        """Stop every child: Envoy and gateways first (no new work), then
        engines, then the scheduler. `grace`: SIGTERM -> SIGKILL for every
        child; None = each child's `stop_grace`."""
        for name in list(self._starts):
            self._end_start(name)
        children = sorted(self._children.values(), key=lambda c: _STOP_RANK[c.spec.role])
        for r in range(len(_STOP_RANK)):
            self._stop([c for c in children if _STOP_RANK[c.spec.role] == r], grace)

    def _stop(self, children: list[_Child], grace: float | None = None) -> None:
        for child in children:
            child.stopping = True
            if child.process is not None and child.process.poll() is None:
                _signal_group(child, signal.SIGTERM)
        signalled = time.monotonic()
        for child in children:
            proc = child.process
            if proc is None:
                continue
            allowed = child.spec.stop_grace if grace is None else grace
            try:
                proc.wait(timeout=max(0.0, signalled + allowed - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s (pid %d) ignored SIGTERM for %.0f s; killing it",
                            child.spec.name, proc.pid, allowed)
            # Also reaps anything the child left in its group (vLLM's engine core).
            _signal_group(child, signal.SIGKILL)
            proc.wait()


def _signal_group(child: _Child, sig: signal.Signals) -> None:
    """Signal the process group this supervisor created for the child (its
    pgid is the child's pid: start_new_session)."""
    proc = child.process
    if proc is None:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)
