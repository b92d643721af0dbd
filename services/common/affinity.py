"""Keep vLLM-CPU's own processes on the cores its OpenMP threads use (and,
in the launcher, the mesh's other processes on the remaining cores).

`omp_threads_bind: all-but-one` binds vLLM's compute threads away from the
lowest core, which is left to Envoy, the gateway, the scheduler and the engine
service. vLLM's engine-core process and its worker's other threads are not
bound by it: they float, and the engine core busy-polls its shared-memory
queue (`sched_yield` for a second after every step,
vllm/distributed/device_communicators/shm_broadcast.py) on whichever core is
free -- usually the mesh's. Pinning every thread of those processes to the
OpenMP cores keeps the spinning where the model runs.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "PinResult",
    "children",
    "descendants",
    "omp_bind_spec",
    "omp_cores",
    "parse_cpus",
    "pin_threads",
    "pin_vllm_processes",
    "vllm_processes",
]

log = logging.getLogger(__name__)

# vLLM names its processes with setproctitle: "VLLM::EngineCore",
# "VLLM::Worker" (vllm/utils/system_utils.py set_process_title).
_VLLM_TITLES = ("EngineCore", "Worker")


@dataclass(frozen=True)
class PinResult:
    pids: tuple[int, ...]
    threads: int


def parse_cpus(spec: str) -> set[int]:
    """"1", "0-3", "0,2-3" -> a set of core numbers (vLLM's OMP bind syntax)."""
    cpus: set[int] = set()
    for raw in spec.replace("|", ",").split(","):
        part = raw.strip()
        if not part:
            continue
        lo, _, hi = part.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            raise ValueError(f"not a core list: {spec!r}")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    if not cpus:
        raise ValueError(f"no cores in {spec!r}")
    return cpus


def omp_bind_spec(setting: str) -> str:
    """VllmConfig.omp_threads_bind -> VLLM_CPU_OMP_THREADS_BIND.

    "all" = every core this process may run on, as ranges ("0-1");
    "all-but-one" = the same without the lowest core (when there are two or
    more), which is left to the mesh's own processes; anything else is passed
    through (vLLM's own syntax, e.g. "0-3" or "auto")."""
    if setting not in ("all", "all-but-one"):
        return setting
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(
        range(os.cpu_count() or 1)
    )
    if setting == "all-but-one" and len(cores) > 1:
        cores = cores[1:]
    ranges: list[str] = []
    start = prev = cores[0]
    for core in cores[1:] + [-1]:
        if core == prev + 1:
            prev = core
            continue
        ranges.append(f"{start}-{prev}" if prev != start else str(start))
        start = prev = core
    return ",".join(ranges)


def omp_cores(setting: str) -> set[int]:
    """The cores VllmConfig.omp_threads_bind names; ValueError when it is
    not a core list ("auto": vLLM decides)."""
    return parse_cpus(omp_bind_spec(setting))


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (every thread's children)."""
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return out


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def descendants(root: int) -> list[int]:
    """Every process below `root` (children, their children, ...)."""
    found: list[int] = []
    stack = children(root)
    while stack:
        pid = stack.pop()
        found.append(pid)
        stack += children(pid)
    return sorted(found)


def vllm_processes(root: int) -> list[int]:
    """Descendants of `root` that are vLLM engine-core or worker processes."""
    return [pid for pid in descendants(root) if any(title in _cmdline(pid) for title in _VLLM_TITLES)]


def pin_threads(pids: list[int], cpus: set[int]) -> int:
    """Pin every thread of `pids` to `cpus`; returns the threads pinned.
    Threads that end meanwhile are skipped; nothing is raised for them."""
    threads = 0
    for pid in pids:
        for task in Path(f"/proc/{pid}/task").glob("*"):
            try:
                os.sched_setaffinity(int(task.name), cpus)
                threads += 1
            except (OSError, ValueError):
                continue
    return threads


def pin_vllm_processes(root: int, cpus: set[int]) -> PinResult:
    """Pin every thread of every vLLM process under `root` to `cpus`."""
    pids = vllm_processes(root)
    return PinResult(tuple(pids), pin_threads(pids, cpus))
