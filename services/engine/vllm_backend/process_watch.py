"""Watch vLLM's own processes: a dead engine core or worker is seen within a
fraction of a second, and the rest of the tree this engine started ends.

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
  its process exits (zombie or gone; for non-children too), so the event
  loop hears of a death at once. A poll of /proc every `poll_seconds` backs
  it up (no pidfd, a missed wake-up).
- On the first death: `death` is set (the backend's `dead_reason()` reports
  it, the liveness watch fails the engine), and every other recorded
  process still running is SIGKILLed, orphans re-parented to 1 included.
  Once the engine stops vLLM itself (`pause()`), an exit is no death: the
  watch says nothing, and `stop()` kills what vLLM's shutdown left.

A recorded PID is only ever signalled through its pidfd (which names that
process, never a later one with the same number), or -- without a pidfd --
after /proc/PID/stat shows the same start time. A stopped process (SIGSTOP)
is alive: a wedged core is the hang detector's case, not this one.

Ownership: one VllmBackend owns one ProcessWatch; everything runs on the
event loop thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from services.common.affinity import descendants

__all__ = ["POLL_SECONDS", "VLLM_TITLE", "Death", "ProcessWatch", "VllmProcess",
           "kill_process", "running", "vllm_descendants"]

log = logging.getLogger("kvmesh.engine.vllm")

VLLM_TITLE = "VLLM::"
# The backup poll: a death is seen within this even without a pidfd wake-up.
POLL_SECONDS = 0.25
# /proc/PID/stat states of a process that has ended (zombie, dead).
_ENDED_STATES = frozenset("ZXx")


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
    engine then SIGKILLed."""

    process: VllmProcess
    last_alive: float
    seen: float
    woken: bool
    killed: tuple[int, ...]

    def describe(self, now: float) -> str:
        kind = "core" if "EngineCore" in self.process.title else "process"
        when = "at its exit (pidfd)" if self.woken else f"within {self.seen - self.last_alive:.2f} s of it (poll)"
        return (f"vLLM {kind} died (pid {self.process.pid}, {self.process.title}): seen {when}, "
                f"{now - self.seen:.2f} s ago; the rest of its tree killed (pids {list(self.killed)})")


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, start_ticks) of `pid`, or None when there is no such process."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after its last ")".
    fields = text.rsplit(")", 1)[1].split()
    return fields[0], int(fields[19])


def _title(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace").strip()
    except OSError:
        return ""


def vllm_descendants(root: int) -> list[VllmProcess]:
    """The running `VLLM::`-titled processes below `root`."""
    found: list[VllmProcess] = []
    for pid in descendants(root):
        title, stat = _title(pid), _stat(pid)
        if title.startswith(VLLM_TITLE) and stat is not None and stat[0] not in _ENDED_STATES:
            found.append(VllmProcess(pid, title, stat[1]))
    return found


def running(process: VllmProcess) -> bool:
    """The same process (PID and start time) exists and has not ended."""
    stat = _stat(process.pid)
    return stat is not None and stat[1] == process.start_ticks and stat[0] not in _ENDED_STATES


def kill_process(process: VllmProcess, pidfd: int | None = None) -> bool:
    """SIGKILL `process` if it still runs; True if a signal went out. Through
    `pidfd` when given (it names exactly that process), else only after its
    start time matches (a reused PID is never hit)."""
    try:
        if pidfd is not None:
            if not running(process):
                return False
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            return True
        if not running(process):
            return False
        os.kill(process.pid, signal.SIGKILL)
        return True
    except (ProcessLookupError, PermissionError):
        return False


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
    """`ProcessWatch(root)`, `start()` once vLLM's processes run, `death`
    once one ended, `await stop()` (kills what is left)."""

    def __init__(self, root: int, on_death: Callable[[Death], None] | None = None,
                 poll_seconds: float = POLL_SECONDS) -> None:
        self._root = root
        self._on_death = on_death
        self.poll_seconds = poll_seconds
        self.processes: list[VllmProcess] = []
        self._pidfds: dict[int, int] = {}
        self._killed: set[int] = set()  # SIGKILLed already (it cannot be caught): not again
        self._last_alive = time.monotonic()
        self._task: asyncio.Task[None] | None = None
        self._paused = False
        self.death: Death | None = None

    def start(self) -> list[VllmProcess]:
        """Record vLLM's processes under the root and watch them; returns them."""
        self.processes = vllm_descendants(self._root)
        loop = asyncio.get_running_loop()
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
            self._task = loop.create_task(self._poll(), name="vllm-process-watch")
        return list(self.processes)

    def look(self, woken: bool = False) -> Death | None:
        """One look at every watched process; the death (recorded once).
        `woken`: a pidfd said a process exited."""
        if self.death is not None or self._paused:
            return self.death
        ended = next((p for p in self.processes if not running(p)), None)
        now = time.monotonic()
        if ended is None:
            self._last_alive = now
            return None
        self._unwatch()
        killed = tuple(self.kill_all())
        self.death = Death(ended, self._last_alive, now, woken, killed)
        log.error("%s", self.death.describe(time.monotonic()))
        if self._on_death is not None:
            self._on_death(self.death)
        return self.death

    def kill_all(self) -> list[int]:
        """SIGKILL every recorded vLLM process still running and every
        `VLLM::` process now under the root; the PIDs signalled."""
        recorded = {p.pid for p in self.processes}
        killed = [p.pid for p in self.processes
                  if p.pid not in self._killed and kill_process(p, self._pidfds.get(p.pid))]
        killed += [p.pid for p in vllm_descendants(self._root)
                   if p.pid not in recorded | self._killed and kill_process(p)]
        self._killed.update(killed)
        return killed

    def pause(self) -> None:
        """vLLM is being shut down: its processes' exits are no deaths."""
        self._paused = True
        self._unwatch()
        if self._task is not None:
            self._task.cancel()

    async def stop(self) -> list[int]:
        """Stop watching and kill what is left of vLLM's tree; the PIDs signalled."""
        self.pause()  # cancels the poll
        task, self._task = self._task, None
        if task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        killed = self.kill_all()
        for fd in self._pidfds.values():
            os.close(fd)
        self._pidfds.clear()
        if killed:
            log.warning("killed vLLM processes left after its shutdown: pids %s", killed)
        return killed

    def _unwatch(self) -> None:
        with contextlib.suppress(RuntimeError):  # the loop may be closing
            loop = asyncio.get_running_loop()
            for fd in self._pidfds.values():
                loop.remove_reader(fd)

    async def _poll(self) -> None:
        # Polled as a backstop to the pidfd wake-ups; /proc says when a process ended.
        while self.look() is None:  # noqa: ASYNC110 - see above
            await asyncio.sleep(self.poll_seconds)
