"""How much the threads of a set of processes ran or wanted to run: the
hang detector's evidence of a backend that is slow rather than hung
(services/engine/slow_or_hung.py).

/proc/PID/task/TID/schedstat holds, per thread, the nanoseconds it spent on
a CPU and the nanoseconds it spent runnable in a run queue waiting for one.
Their sum grows for a thread that computes, spins, or is starved of a core
by other work; it stands still for a thread that is blocked (waiting on a
lock, a pipe, a message that will not come) or stopped. Every thread
counts: vLLM's worker computes in OpenMP threads, not its main one.

/proc/PID/stat's state says whether a process is stopped (T: SIGSTOP, t: a
tracer): such a process makes no progress whatever its threads' figures.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from services.engine.backend import BackendActivity
from services.engine.vllm_backend.proc_state import read_state

__all__ = ["STOPPED_STATES", "runnable_seconds", "tree_activity"]

# /proc/PID/stat states of a stopped process (SIGSTOP; stopped by a tracer).
STOPPED_STATES = frozenset("Tt")


def runnable_seconds(pid: int) -> float:
    """Seconds the threads of `pid` have been on a CPU or waiting for one;
    0.0 for a process that is gone (its threads' figures went with it)."""
    total = 0
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0.0
    for tid in tids:
        try:
            on_cpu, waiting = Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[:2]
        except (OSError, ValueError):  # the thread ended meanwhile
            continue
        total += int(on_cpu) + int(waiting)
    return total / 1e9


def tree_activity(processes: Iterable[tuple[int, str]]) -> BackendActivity:
    """The activity of these (pid, title) processes together: their summed
    runnable seconds, and the first one found stopped."""
    total, stopped = 0.0, None
    for pid, title in processes:
        state = read_state(pid)
        if state is None:
            continue
        if stopped is None and state.state in STOPPED_STATES:
            stopped = f"{title} (pid {pid}) is stopped (state {state.state})"
        total += runnable_seconds(pid)
    return BackendActivity(total, stopped)
