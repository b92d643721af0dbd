"""A process's CPU time and resident memory from /proc (Linux).

The scheduler's CPU is read from its own /proc/PID/stat before and after a
step, so what the synthetic gateways and engines spend is never counted."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

__all__ = ["ProcSample", "cpu_seconds", "run_delay_seconds", "rss_kib", "sample"]

_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(stat_text: str, ticks_per_second: int = _TICKS) -> float:
    """utime + stime (fields 14 and 15 of /proc/PID/stat) in seconds. The
    command name (field 2) may hold spaces and parentheses: fields are
    counted after its last ')'."""
    fields = stat_text.rsplit(")", 1)[1].split()
    # fields[0] is field 3 (state): utime is field 14, stime field 15.
    return (int(fields[11]) + int(fields[12])) / ticks_per_second


def rss_kib(status_text: str) -> int:
    """VmRSS of /proc/PID/status in KiB (0 when absent: a zombie)."""
    for line in status_text.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def run_delay_seconds(schedstat_texts: list[str]) -> float:
    """Time the threads spent runnable but waiting for a CPU (the second
    field of each /proc/PID/task/TID/schedstat, in ns): how much the
    machine's other work held the process back."""
    return sum(int(text.split()[1]) for text in schedstat_texts if text.strip()) / 1e9


@dataclass(frozen=True)
class ProcSample:
    cpu_s: float
    rss_kib: int
    waited_s: float = 0.0     # runnable, waiting for a CPU (all threads)


def _schedstats(base: Path) -> list[str]:
    out = []
    for task in base.glob("task/*/schedstat"):
        try:
            out.append(task.read_text())
        except OSError:   # the thread ended meanwhile
            continue
    return out


def sample(pid: int) -> ProcSample:
    """CPU seconds, RSS and CPU wait of `pid` now (its threads included)."""
    base = Path(f"/proc/{pid}")
    return ProcSample(cpu_seconds((base / "stat").read_text()), rss_kib((base / "status").read_text()),
                      run_delay_seconds(_schedstats(base)))
