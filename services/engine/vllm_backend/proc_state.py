"""What /proc/PID/stat says of one process: running, or already ending.

A SIGKILLed process is dead from the moment the signal is sent (it cannot be
caught, blocked or ignored), but it is gone -- a zombie, its pidfd readable
-- only once the kernel has taken every one of its threads out and torn it
down. So a process counts as ending at the first of:

- SIGKILL pending: the kill sets it on every thread at once (a group exit),
  before any of them has run; each clears its own as it begins to exit;
- PF_EXITING in its flags: its main thread is in the kernel's exit (set as
  that begins, before its memory and files are released);
- a state of Z (zombie) or X (dead): it has exited.

All three are in the one file, read in one go (a look costs one read per
process). A stopped process (T, SIGSTOP) is not ending: a wedged process
is the hang detector's case.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass
from pathlib import Path

__all__ = ["PF_EXITING", "ProcState", "parse_stat", "read_state"]

# include/linux/sched.h: the task has begun to exit (do_exit sets it first).
PF_EXITING = 0x4
_SIGKILL = 1 << (signal.SIGKILL - 1)
# /proc/PID/stat states of a process that has ended (zombie, dead).
_ENDED_STATES = frozenset("ZXx")
# Fields of /proc/PID/stat after the command name (field 2), 0 = field 3.
_STATE, _FLAGS, _START, _PENDING = 0, 9 - 3, 22 - 3, 31 - 3


@dataclass(frozen=True)
class ProcState:
    """`state` (field 3), `flags` (field 9, the kernel's PF_* bits),
    `start_ticks` (field 22, clock ticks after boot: tells a process from
    a later one given the same PID), `pending` (field 31: the signals
    pending on its main thread, a bit per signal)."""

    state: str
    flags: int
    start_ticks: int
    pending: int

    def ending(self) -> str | None:
        """Why this process is ending (see the module docstring), or None."""
        if self.state in _ENDED_STATES:
            return "exited"
        if self.flags & PF_EXITING:
            return "exiting"
        if self.pending & _SIGKILL:
            return "SIGKILL pending"
        return None


def parse_stat(text: str) -> ProcState:
    """A /proc/PID/stat line. The command name (field 2) may hold spaces and
    parentheses: the fields are split after its last ")"."""
    fields = text.rsplit(")", 1)[1].split()
    return ProcState(fields[_STATE], int(fields[_FLAGS]), int(fields[_START]), int(fields[_PENDING]))


def read_state(pid: int) -> ProcState | None:
    """`pid`'s state now, or None when there is no such process."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return parse_stat(text)
