"""The "Control plane capacity" section of BENCHMARKS.md: rendered from a
run's tables and written in place of the old one (or appended)."""

from __future__ import annotations

import os
import platform
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from .figures import P99_LIMIT_MS, Baseline, StepFigures, capacity, render_table, replica_list

__all__ = ["SECTION", "FleetResult", "capacity_table", "machine", "render_section", "replace_section",
           "summary_line"]

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


def _cpu(step: StepFigures) -> str:
    """The CPU per admission, summed; several replicas: and each one's part."""
    text = f"{step.cpu_ms_per_admission:.2f} ms"
    if step.schedulers > 1 and step.replica_cpu_s:
        text += f" ({replica_list(step.replica_cpu_ms_per_admission, '.2f', ' + ')} per replica)"
    return text


def _split(step: StepFigures) -> str:
    """Several replicas: the share of the admissions each placed."""
    if step.schedulers <= 1 or not step.replica_placed or not sum(step.replica_placed):
        return ""
    shares = tuple(n / sum(step.replica_placed) for n in step.replica_placed)
    return f", admissions per replica {replica_list(shares, '.0%')}"


def _memory(b: Baseline) -> str:
    per_replica = "" if b.schedulers <= 1 or not b.replica_rss_fleet_kib else \
        f" (each replica's: {replica_list(tuple(k / 1024 for k in b.replica_rss_fleet_kib), '.0f')} MiB)"
    each = " each" if b.schedulers > 1 else ""
    return (f"scheduler RSS {b.rss_empty_kib / 1024:.0f} MiB empty, {b.rss_fleet_kib / 1024:.0f} MiB with "
            f"the fleet{per_replica}: {b.kib_per_engine:.0f} KiB per engine{each}; the fleet's reports alone "
            f"(no admissions) {b.idle_core_share:.0%} of a core; the fleet registered in {b.register_seconds:.1f} s "
            f"({b.register_cpu_s:.1f} s of scheduler CPU)")


def summary_line(result: FleetResult) -> str:
    """Capacity, its CPU per admission, and memory per engine, for one run."""
    best, top = capacity(result.steps), capacity(result.steps, None)
    b = result.baseline
    fleet = f"{b.engines} engines, {b.schedulers} scheduler{'s' if b.schedulers > 1 else ''}"
    carried = ("no step carried" if top is None else
               f"highest step carried {top.offered:g}/s (p99 {top.p99_ms:.1f} ms, "
               f"{_cpu(top)} scheduler CPU per admission{_split(top)})")
    if best is None:
        return f"{fleet}: capacity **none** (no step carried with p99 <= {P99_LIMIT_MS:g} ms); " \
               f"{carried}; {_memory(b)}"
    return (f"{fleet}: capacity **{best.offered:g} admissions/s** (sustained {best.sustained:.0f}/s, "
            f"p99 {best.p99_ms:.2f} ms, scheduler {_cpu(best)} CPU per admission{_split(best)}); "
            f"{carried}; {_memory(b)}")


def capacity_table(results: Sequence[FleetResult]) -> str:
    """Engines down, schedulers across: each cell the capacity (admissions/s
    with p99 <= the limit) and its scheduler CPU per admission, summed over
    the replicas; several runs of one cell: each, separated by " / "."""
    fleets = sorted({r.baseline.engines for r in results})
    counts = sorted({r.baseline.schedulers for r in results})
    cells: dict[tuple[int, int], list[str]] = {}
    for r in results:
        best = capacity(r.steps)
        text = "none" if best is None else f"{best.offered:g} ({best.cpu_ms_per_admission:.2f} ms)"
        cells.setdefault((r.baseline.engines, r.baseline.schedulers), []).append(text)
    head = "| engines | " + " | ".join(f"{n} scheduler{'s' if n > 1 else ''}" for n in counts) + " |"
    lines = [head, "|---:|" + "---:|" * len(counts)]
    lines += [f"| {e} | " + " | ".join(" / ".join(cells.get((e, n), ["-"])) for n in counts) + " |"
              for e in fleets]
    return "\n".join(lines)


_ABOUT = """\
Defaults shown (the command above names any change). N scheduler processes (the `schedulers` column)
started as `kvmesh up --schedulers N` starts them (default config: `predicted_ttft`, INFO logging), over
gRPC on loopback. Synthetic engines (scripts/cplib/engines.py; up to 512 per process, one connection per
replica each) send every replica hello, a KV snapshot, load reports every 100 ms when changed and at
least every 0.5 s, promptly (<= 25 ms; with several replicas at once) after a request starts or ends,
and KV events, as services/engine/scheduler_link.py does; with several replicas each report lists only
that replica's generations and counts the others (`other_replica_generations`). Synthetic gateways (2
processes) admit through the gateway's own `SchedulerReplicas` / `SchedulerClient` / `AdmitSession`
(spare calls included; each request on the replica its id ranks first by rendezvous hashing, its
`Placed.scheduler_replica` carried to the engine): AdmitRequest
with 125 + 2 prefix hashes (64 shared 2,000-token contexts), Placed, FirstToken 20 ms later, RequestDone
after a hold of 50-200 ms; Poisson arrivals, open loop, each step twice the last, until a step is not
carried (< 95% of its arrivals placed within it). Columns: latency p50 / p99 at the gateway (Admit sent
-> Placed received; unplaced requests count as the slowest); the scheduler's own
`kvmesh_scheduler_decision_seconds` (policy time only, from /metrics, every replica's merged; inf = past
its last bucket, 100 ms); its CPU (utime + stime from /proc, arrivals and their leases' ends) per
admission, summed over the replicas and, with several, each replica's part in brackets (its CPU over all
admissions); its share of a core (replicas summed); its CPU wait (schedstat run delay, all threads
summed: time it was runnable but another process had the CPU); the synthetic processes' CPU in cores;
load reports + KV messages the engines sent per second (to all replicas); the scheduler's RSS (each
replica's). Capacity: the highest step carried with p99 <= 5 ms."""


def render_section(command: str, when: str, load: str, results: Sequence[FleetResult], notes: str = "") -> str:
    lines = [SECTION, "", "```", command, "```", "",
             f"Measured {when} on {machine()}; {load}.", "", _ABOUT, ""]
    lines += [f"- {summary_line(r)}" for r in results]
    if len({r.baseline.schedulers for r in results}) > 1:
        lines += ["", "Capacity, admissions/s with decision p99 <= "
                  f"{P99_LIMIT_MS:g} ms (scheduler CPU per admission, all replicas summed):", "",
                  capacity_table(results)]
    runs: dict[tuple[int, int], int] = {}
    numbered = []
    for r in results:
        key = (r.baseline.engines, r.baseline.schedulers)
        runs[key] = runs.get(key, 0) + 1
        numbered.append((runs[key], r.steps))
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
