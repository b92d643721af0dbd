"""The "Control plane capacity" section of BENCHMARKS.md: rendered from a
run's tables and written in place of the old one (or appended)."""

from __future__ import annotations

import os
import platform
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from .figures import P99_LIMIT_MS, Baseline, StepFigures, capacity, render_table

__all__ = ["SECTION", "FleetResult", "machine", "render_section", "replace_section", "summary_line"]

SECTION = "## Control plane capacity"


@dataclass(frozen=True)
class FleetResult:
    baseline: Baseline
    steps: list[StepFigures]


def machine() -> str:
    """CPU model and core count of this machine."""
    model = platform.processor() or "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{os.cpu_count()} cores ({model}), {platform.system()} {platform.release()}"


def summary_line(result: FleetResult) -> str:
    """Capacity, its CPU per admission, and memory per engine, for one run."""
    best, top = capacity(result.steps), capacity(result.steps, None)
    b = result.baseline
    memory = (f"scheduler RSS {b.rss_empty_kib / 1024:.0f} MiB empty, {b.rss_fleet_kib / 1024:.0f} MiB with "
              f"the fleet: {b.kib_per_engine:.0f} KiB per engine; the fleet's reports alone (no admissions) "
              f"{b.idle_core_share:.0%} of a core")
    carried = ("no step carried" if top is None else
               f"highest step carried {top.offered:g}/s (p99 {top.p99_ms:.1f} ms, "
               f"{top.cpu_ms_per_admission:.2f} ms scheduler CPU per admission)")
    if best is None:
        return f"{b.engines} engines: capacity **none** (no step carried with p99 <= {P99_LIMIT_MS:g} ms); " \
               f"{carried}; {memory}"
    return (f"{b.engines} engines: capacity **{best.offered:g} admissions/s** (sustained {best.sustained:.0f}/s, "
            f"p99 {best.p99_ms:.2f} ms, scheduler {best.cpu_ms_per_admission:.2f} ms CPU per admission); "
            f"{carried}; {memory}")


_ABOUT = """\
Defaults shown (the command above names any change). One scheduler process started as `kvmesh up` starts
it (default config: `predicted_ttft`, INFO logging), over gRPC on loopback. Synthetic engines
(scripts/cplib/engines.py; up to 512 per process, one connection each) send hello, a KV snapshot, load
reports every 100 ms when changed and at least every 0.5 s, promptly (<= 25 ms) after a request starts
or ends, and KV events, as services/engine/scheduler_link.py does. Synthetic gateways (2 processes)
admit through the gateway's own `SchedulerClient` / `AdmitSession` (spare call included): AdmitRequest
with 125 + 2 prefix hashes (64 shared 2,000-token contexts), Placed, FirstToken 20 ms later, RequestDone
after a hold of 50-200 ms; Poisson arrivals, open loop, each step twice the last, until a step is not
carried (< 95% of its arrivals placed within it). Columns: latency p50 / p99 at the gateway (Admit sent
-> Placed received; unplaced requests count as the slowest); the scheduler's own
`kvmesh_scheduler_decision_seconds` (policy time only, from /metrics; inf = past its last bucket, 100
ms); its CPU (utime + stime from /proc, arrivals and their leases' ends) per admission; its share of a
core; its CPU wait (schedstat run delay, all threads summed: time it was runnable but another process
had the CPU); the synthetic processes' CPU in cores; load reports + KV messages the engines sent per
second; the scheduler's RSS. Capacity: the highest step carried with p99 <= 5 ms."""


def render_section(command: str, when: str, load: str, results: Sequence[FleetResult], notes: str = "") -> str:
    lines = [SECTION, "", "```", command, "```", "",
             f"Measured {when} on {machine()}; {load}.", "", _ABOUT, ""]
    lines += [f"- {summary_line(r)}" for r in results]
    runs: dict[int, int] = {}
    numbered = []
    for r in results:
        runs[r.baseline.engines] = runs.get(r.baseline.engines, 0) + 1
        numbered.append((runs[r.baseline.engines], r.steps))
    lines += ["", render_table(numbered)]
    if notes:
        lines += ["", notes.strip()]
    return "\n".join(lines) + "\n"


def replace_section(document: str, text: str) -> str:
    """`document` with its control-plane section replaced by `text` (appended
    when there is none)."""
    start = document.find(SECTION + "\n")
    if start < 0:
        return document.rstrip("\n") + "\n\n" + text
    end = document.find("\n## ", start + len(SECTION))
    return document[:start] + text + (document[end:] if end >= 0 else "")
