"""Watch vLLM's own processes: a dead engine core or worker is seen within a
fraction of a second of its kill, and the rest of the tree this engine
started ends.

vLLM's client notices a dead core late: SIGKILL of `VLLM::EngineCore` left
its `VLLM::Worker` running with parent 1, and the engine learnt of the
death only ~58-70 s later (its liveness probe, or `EngineDeadError` at
last) -- a minute in which the scheduler placed work on a core that was
gone, and the orphan (pinned to the other engine's cores; on a GPU node
holding its memory) slowed everything else. So the engine watches the
processes themselves, whatever vLLM's client notices:

- `ProcessWatch.start()` records every `VLLM::`-titled descendant of the
  engine process (vLLM names its processes with setproctitle:
  `VLLM::EngineCore`, `VLLM::Worker`) with its start time from
  /proc/PID/stat, and opens a pidfd for each: a pidfd becomes readable when
  its process has exited (zombie or gone; for non-children too).
- A process is dead from its kill on, not from its exit: the kernel tears
  a SIGKILLed process down before its pidfd says so (every thread out,
  its memory and files released: 0.1-0.4 s for vLLM's core and worker
  here, more on a loaded machine; a death once waited for that was logged
  9.8 s after the kill). So a thread looks at /proc every `poll_seconds`
  and takes a process for dead as soon as it is ending (proc_state.py:
  SIGKILL pending, exiting, or exited) -- within milliseconds of the kill.
  The thread, not the event loop: a loop held up (a blocking call, a
  burst of work) would see the death late.
- On the first death: `death` is recorded (the backend's `dead_reason()`
  reports it, the liveness watch fails the engine on the event loop:
  NOT_SERVING, then its streams end), and every other recorded process
  still running is SIGKILLed, orphans re-parented to 1 included; the dying
  ones are let off their pinned cores, so their teardown is not slowed by
  the other engine's busy threads there (`release_cores`).
  `on_death` runs on the event loop. Once the engine stops vLLM itself
  (`pause()`), an exit is no death: the watch says nothing, and `stop()`
  kills what vLLM's shutdown left, then waits until the whole tree is gone
  (its memory freed) so that a restarted engine finds the room.

A recorded PID is only ever signalled through its pidfd (which names that
process, never a later one with the same number), or -- without a pidfd --
after /proc/PID/stat shows the same start time. A stopped process (SIGSTOP)
is alive: a wedged core is the hang detector's case, not this one.

Ownership: one VllmBackend owns one ProcessWatch, on the event loop thread;
the poll thread shares only what `_lock` guards (`look`, `pause`,
`kill_all`), and hands a death to the loop with call_soon_threadsafe.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from services.common.affinity import children, pin_threads
from services.engine.backend import BackendActivity
from services.engine.vllm_backend.proc_activity import tree_activity
from services.engine.vllm_backend.proc_state import read_state

__all__ = ["EXIT_WAIT_SECONDS", "POLL_SECONDS", "VLLM_TITLE", "Death", "ProcessWatch", "VllmProcess",
           "kill_process", "release_cores", "running", "vllm_descendants"]

log = logging.getLogger("kvmesh.engine.vllm")

VLLM_TITLE = "VLLM::"
# How often the thread looks: a kill is seen within this. A look is one
# /proc read per process (two here), so ten a second cost nothing.
POLL_SECONDS = 0.1
# How long stop() waits for vLLM's processes to be gone once it killed
# them: the kernel frees a killed process's memory (on a GPU node its GPU
# memory too) as it tears it down, which took seconds on a loaded machine,
# and the engine's restart must find it free. Past this it goes on without.
EXIT_WAIT_SECONDS = 30.0
_GONE = frozenset({"exited", "gone"})


@dataclass(frozen=True)
class VllmProcess:
    """One vLLM process as first seen: `start_ticks` (field 22 of
    /proc/PID/stat, clock ticks after boot) tells it from a later process
    given the same PID."""

    pid: int
    title: str
    start_ticks: int


@dataclass(frozen=True)
class Death:
    """A watched process ended. `last_alive`: the monotonic time it was
    last seen running; `seen`: when its end was seen; `woken`: seen through
    its pidfd (at its exit) rather than by the poll (within `seen -
    last_alive` of it); `killed`: the PIDs of the rest of the tree this
    engine then SIGKILLed; `how`: what /proc showed (proc_state.py)."""

    process: VllmProcess
    last_alive: float
    seen: float
    woken: bool
    killed: tuple[int, ...]
    how: str = "exited"

    def describe(self, now: float) -> str:
        kind = "core" if "EngineCore" in self.process.title else "process"
        when = "at its exit (pidfd)" if self.woken else f"within {self.seen - self.last_alive:.2f} s of it (poll)"
        return (f"vLLM {kind} died (pid {self.process.pid}, {self.process.title}): {self.how}, seen {when}, "
                f"{now - self.seen:.2f} s ago; the rest of its tree killed (pids {list(self.killed)})")


def _title(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace").strip()
    except OSError:
        return ""


def ending(process: VllmProcess) -> str | None:
    """Why `process` is no longer alive (proc_state.py; "gone": no such
    process, or its PID now names another), or None while it runs."""
    state = read_state(process.pid)
    if state is None or state.start_ticks != process.start_ticks:
        return "gone"
    return state.ending()


def vllm_descendants(root: int, foreign: frozenset[tuple[int, int]] = frozenset()) -> list[VllmProcess]:
    """The running `VLLM::`-titled processes `root` started: its
    `VLLM::` children and theirs, down through `VLLM::` processes only,
    leaving out the `foreign` ones (PID, start ticks) and what is under
    them. A `VLLM::` process below another kind (another engine's, under
    that engine's own process) is not `root`'s: a test process hosting an
    in-process backend beside whole meshes took every mesh's vLLM for its
    own, and its stop SIGKILLed them all."""
    found: list[VllmProcess] = []
    stack = children(root)
    while stack:
        pid = stack.pop()
        title, state = _title(pid), read_state(pid)
        if (not title.startswith(VLLM_TITLE) or state is None or state.ending() is not None
                or (pid, state.start_ticks) in foreign):
            continue
        found.append(VllmProcess(pid, title, state.start_ticks))
        stack += children(pid)
    return sorted(found, key=lambda p: p.pid)


def running(process: VllmProcess) -> bool:
    """The same process (PID and start time) exists and is not ending."""
    return ending(process) is None


def kill_process(process: VllmProcess, pidfd: int | None = None) -> bool:
    """SIGKILL `process` if it still runs; True if a signal went out. Through
    `pidfd` when given (it names exactly that process), else only after its
    start time matches (a reused PID is never hit)."""
    try:
        if not running(process):
            return False
        if pidfd is not None:
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        else:
            os.kill(process.pid, signal.SIGKILL)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def release_cores(pids: list[int]) -> int:
    """Let the threads of dying processes run on this engine's cores too;
    the threads moved. vLLM's are pinned to the OpenMP cores, which the
    other engine's busy threads share, and the kernel tears a killed
    process down (frees its memory) on its own threads: 1 GiB pinned to a
    busy core took 1.7-2.1 s, 0.7-1.1 s once let onto both cores."""
    moved = 0
    for pid in pids:
        with contextlib.suppress(OSError):  # gone meanwhile
            moved += pin_threads([pid], os.sched_getaffinity(0) | os.sched_getaffinity(pid))
    return moved


def _open_pidfd(process: VllmProcess) -> int | None:
    """A pidfd for `process`, checked to be that process (not a reused PID)."""
    try:
        fd = os.pidfd_open(process.pid)
    except (OSError, AttributeError):  # gone already, or no pidfd on this kernel
        return None
    if not running(process):  # opened after the PID was reused, or it ended: no use
        os.close(fd)
        return None
    return fd


class ProcessWatch:
    """`ProcessWatch(root)`, `start()` (on the event loop) once vLLM's
    processes run, `death` once one ended, `await stop()` (kills what is left)."""

    def __init__(self, root: int, on_death: Callable[[Death], None] | None = None,
                 poll_seconds: float = POLL_SECONDS, exit_wait_seconds: float = EXIT_WAIT_SECONDS,
                 foreign: frozenset[tuple[int, int]] = frozenset()) -> None:
        self._root = root
        self._foreign = foreign  # vLLM processes under the root that are not this engine's (vllm_descendants)
        self._on_death = on_death
        self.poll_seconds = poll_seconds
        self.exit_wait_seconds = exit_wait_seconds
        self.processes: list[VllmProcess] = []
        self._found: list[VllmProcess] = []  # killed though not recorded at start
        self._pidfds: dict[int, int] = {}
        self._killed: set[int] = set()  # SIGKILLed already (it cannot be caught): not again
        self._last_alive = time.monotonic()
        self._lock = threading.Lock()
        self._done = threading.Event()  # the poll thread's end
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._paused = False
        self.death: Death | None = None

    def start(self) -> list[VllmProcess]:
        """Record vLLM's processes under the root and watch them; returns them."""
        self.processes = vllm_descendants(self._root, self._foreign)
        self._loop = loop = asyncio.get_running_loop()
        for process in self.processes:
            fd = _open_pidfd(process)
            if fd is not None:
                self._pidfds[process.pid] = fd
                loop.add_reader(fd, self.look, True)
        self._last_alive = time.monotonic()
        if not self.processes:
            log.warning("no %s process under pid %d: vLLM's processes are not watched", VLLM_TITLE, self._root)
        else:
            log.info("watching vLLM's processes: %s (%d pidfds)",
                     ", ".join(f"{p.title} pid {p.pid}" for p in self.processes), len(self._pidfds))
            self._thread = threading.Thread(target=self._poll, name="vllm-process-watch", daemon=True)
            self._thread.start()
        return list(self.processes)

    def look(self, woken: bool = False) -> Death | None:
        """One look at every watched process; the death (recorded once).
        `woken`: a pidfd said a process exited. From any thread."""
        with self._lock:
            if self.death is not None or self._paused:
                return self.death
            ended = next(((p, how) for p in self.processes if (how := ending(p)) is not None), None)
            now = time.monotonic()
            if ended is None:
                self._last_alive = now
                return None
            killed = tuple(self._kill_all())
            death = self.death = Death(ended[0], self._last_alive, now, woken, killed, ended[1])
            if death.how != "gone":  # not reaped yet: its PID still names it
                release_cores([death.process.pid])
        log.error("%s", death.describe(time.monotonic()))
        self._hand_over(death)
        return death

    def activity(self) -> BackendActivity:
        """How much the recorded processes ran or waited to run, and whether
        one is stopped (proc_activity.py): read only once the engine has
        been silent past its hang bound."""
        with self._lock:
            processes = [(p.pid, p.title) for p in self.processes]
        return tree_activity(processes)

    def kill_all(self) -> list[int]:
        """SIGKILL every recorded vLLM process still running and every
        `VLLM::` process now under the root; the PIDs signalled."""
        with self._lock:
            return self._kill_all()

    def pause(self) -> None:
        """vLLM is being shut down: its processes' exits are no deaths."""
        with self._lock:
            self._paused = True
        self._done.set()
        self._unwatch()

    async def stop(self) -> list[int]:
        """Stop watching, kill what is left of vLLM's tree and wait (up to
        `exit_wait_seconds`) until all of it is gone; the PIDs signalled."""
        self.pause()  # ends the poll thread
        thread, self._thread = self._thread, None
        if thread is not None:
            await asyncio.to_thread(thread.join)
        killed = self.kill_all()
        if killed:
            log.warning("killed vLLM processes left after its shutdown: pids %s", killed)
        await self._wait_gone()
        for fd in self._pidfds.values():
            os.close(fd)
        self._pidfds.clear()
        return killed

    async def _wait_gone(self) -> None:
        """Until every process of the tree is gone (exited or reaped); how
        long that took is logged when it took long -- the kernel's teardown
        of a killed process, the time the death is no longer waited for."""
        began = time.monotonic()
        left = [p for p in self.processes + self._found if ending(p) not in _GONE]
        while left and time.monotonic() - began <= self.exit_wait_seconds:
            await asyncio.sleep(0.05)
            left = [p for p in left if ending(p) not in _GONE]
        now = time.monotonic()
        since = f"{now - began:.1f} s after stop's kill" + (
            "" if self.death is None else f", {now - self.death.seen:.1f} s after the death was seen")
        if left:
            log.warning("vLLM processes still not gone %s: %s", since,
                        ", ".join(f"{p.title} pid {p.pid}" for p in left))
        elif now - began > 1.0 or (self.death is not None and now - self.death.seen > 1.0):
            log.info("vLLM's processes gone %s", since)

    def _kill_all(self) -> list[int]:
        recorded = {p.pid for p in self.processes}
        killed = [p.pid for p in self.processes
                  if p.pid not in self._killed and kill_process(p, self._pidfds.get(p.pid))]
        found = [p for p in vllm_descendants(self._root, self._foreign)
                 if p.pid not in recorded | self._killed and kill_process(p)]
        self._found += found
        killed += [p.pid for p in found]
        self._killed.update(killed)
        release_cores(killed)
        return killed

    def _hand_over(self, death: Death) -> None:
        """The death to the event loop: its pidfd readers go, `on_death` runs there."""
        loop = self._loop
        if loop is None or _running_loop() is loop:
            self._handed_over(death)
            return
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody left to tell
            loop.call_soon_threadsafe(self._handed_over, death)

    def _handed_over(self, death: Death) -> None:
        self._unwatch()
        if self._on_death is not None:
            self._on_death(death)

    def _unwatch(self) -> None:
        loop = self._loop
        if loop is None or loop.is_closed() or _running_loop() is not loop:
            return
        for fd in self._pidfds.values():
            loop.remove_reader(fd)

    def _poll(self) -> None:
        # A thread of its own: a held event loop (a blocking call, a burst
        # of work) must not delay the look; it takes the loop's turn only
        # to hand the death over.
        while not self._done.wait(self.poll_seconds):
            try:
                if self.look() is not None:
                    return
            except Exception:  # a look that failed must not end the watch
                log.exception("a look at vLLM's processes failed")


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
