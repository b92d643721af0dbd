"""proc_state: a process counts as ending at the first sign in
/proc/PID/stat -- SIGKILL pending, PF_EXITING, a zombie or dead state --
and a stopped or merely signalled process does not."""

from __future__ import annotations

import os
import signal

import pytest

from services.engine.vllm_backend.proc_state import PF_EXITING, ProcState, parse_stat, read_state

# A real line's shape (52 fields), with the four fields read here set per case.
_TAIL = ("1 {pid} {pid} 0 -1 {flags} 2301 0 0 0 12 3 0 0 20 0 9 0 {start} 4096000 900 "
         "18446744073709551615 1 1 0 0 0 {pending} 0 0 0 0 0 0 17 1 0 0 0 0 0 0 0 0 0 0 0 0 0")
_FLAGS = 0x400000 | 0x40  # PF_RANDOMIZE, PF_FORKNOEXEC: an ordinary live process
_SIGKILL = 1 << (signal.SIGKILL - 1)


def stat_line(state: str, flags: int = _FLAGS, pending: int = 0, name: str = "VLLM::Worker",
              start: int = 4321) -> str:
    return f"77 ({name}) {state} " + _TAIL.format(pid=77, flags=flags, start=start, pending=pending)


@pytest.mark.parametrize(("state", "flags", "pending", "why"), [
    ("S", _FLAGS, 0, None),
    ("R", _FLAGS, 0, None),
    ("D", _FLAGS, 0, None),
    ("T", _FLAGS, 0, None),  # SIGSTOPped: a wedged core is the hang detector's case
    ("t", _FLAGS, 0, None),
    ("S", _FLAGS, 1 << (signal.SIGTERM - 1), None),  # a catchable signal is no death
    ("S", _FLAGS, 1 << (signal.SIGSTOP - 1), None),
    ("S", _FLAGS, _SIGKILL, "SIGKILL pending"),  # killed, no thread has run since
    ("D", _FLAGS, _SIGKILL | (1 << (signal.SIGTERM - 1)), "SIGKILL pending"),
    ("R", _FLAGS | PF_EXITING, 0, "exiting"),  # tearing down: memory, files
    ("D", _FLAGS | PF_EXITING, _SIGKILL, "exiting"),
    ("Z", _FLAGS | PF_EXITING, 0, "exited"),
    ("X", _FLAGS | PF_EXITING, 0, "exited"),
    ("x", _FLAGS | PF_EXITING, 0, "exited"),
])
def test_a_process_is_ending_at_the_first_sign(state: str, flags: int, pending: int, why: str | None) -> None:
    parsed = parse_stat(stat_line(state, flags, pending))
    assert parsed == ProcState(state, flags, 4321, pending)
    assert parsed.ending() == why


@pytest.mark.parametrize("name", ["VLLM::Worker", "a (b) c", "x)", ") S 1 2 3 ("])
def test_the_command_name_may_hold_spaces_and_parentheses(name: str) -> None:
    assert parse_stat(stat_line("S", pending=_SIGKILL, name=name, start=99)) == ProcState("S", _FLAGS, 99, _SIGKILL)


def test_a_live_process_is_not_ending_and_a_missing_one_has_no_state() -> None:
    own = read_state(os.getpid())
    assert own is not None and own.state == "R" and own.ending() is None
    assert own.flags & PF_EXITING == 0 and own.start_ticks > 0
    assert read_state(2**22 + 1) is None  # above pid_max's ceiling: no such process
