"""One step's figures, the fleet's capacity, and the table.

Decision latency is measured at the synthetic gateway (Admit sent -> Placed
received); a request never placed within the step's grace counts as slower
than every placed one (it is in the tail, not left out). The scheduler's CPU
per admission is its own /proc utime + stime over the step (arrivals and the
drain of their leases) divided by the admissions placed in it.

With several scheduler replicas the CPU is summed over their processes
(and shown per process: each one's CPU over all admissions, so the parts
add up to the sum), the decision histogram is theirs merged, and RSS is
each replica's.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["TABLE_HEADER", "Baseline", "StepFigures", "capacity", "latency_percentile", "render_row", "render_table",
           "replica_list"]

# A step is carried when it placed at least this share of what it sent
# within its window (below it, arrivals pile up: the rate is not carried).
# Of what it sent, not rate x seconds: Poisson arrivals vary by sqrt(n).
SUSTAINED_SHARE = 0.95
P99_LIMIT_MS = 5.0


def latency_percentile(latencies: Sequence[float], missing: int, p: float) -> float:
    """The p-th percentile (linear interpolation, as services/bench/stats.py)
    of `latencies` plus `missing` values larger than all of them: infinite
    when the percentile reaches among those; NaN with nothing at all."""
    if not 0 <= p <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {p}")
    data = sorted(latencies)
    total = len(data) + missing
    if total == 0:
        return math.nan
    rank = (total - 1) * p / 100.0
    lo = math.floor(rank)
    hi = min(lo + 1, total - 1)
    if lo >= len(data) or (hi >= len(data) and rank > lo):
        return math.inf
    if hi >= len(data):
        return data[lo]
    return data[lo] + (data[hi] - data[lo]) * (rank - lo)


@dataclass(frozen=True)
class Baseline:
    """The scheduler before the steps: RSS with no engine, then with all
    (several replicas: their mean; each holds the whole fleet), and the
    share of a core the fleet's reports alone take (no admissions; several
    replicas: summed)."""

    engines: int
    rss_empty_kib: int
    rss_fleet_kib: int
    idle_core_share: float = 0.0
    schedulers: int = 1
    replica_rss_fleet_kib: tuple[int, ...] = ()     # each replica's, with the fleet
    register_seconds: float = 0.0    # the engines' start to every replica seeing all of them fresh
    register_cpu_s: float = 0.0      # the replicas' CPU meanwhile (summed)

    @property
    def kib_per_engine(self) -> float:
        return (self.rss_fleet_kib - self.rss_empty_kib) / max(1, self.engines)


@dataclass(frozen=True)
class StepFigures:
    engines: int
    offered: float                   # admissions/s asked for
    seconds: float
    sent: int
    placed: int                      # placed at all (within the grace)
    placed_in_window: int
    rejected: int
    unplaced: int
    p50_ms: float
    p99_ms: float
    hist_p50_ms: float               # the scheduler's decision_seconds histogram
    hist_p99_ms: float
    sched_cpu_s: float
    sched_waited_s: float            # runnable but waiting for a CPU (the machine's other work)
    driver_cpu_s: float              # synthetic gateways + engines, summed
    wall_s: float                    # from the first sample to the last
    rss_kib: int
    late_p99_ms: float               # gateways behind their arrival schedule
    engine_messages: int             # loads, KV events and snapshots the engines sent (to all replicas)
    schedulers: int = 1
    # Per replica, in start order: its CPU over the step (sched_cpu_s is
    # their sum), its RSS after the step (rss_kib is the largest), and the
    # admissions placed through it.
    replica_cpu_s: tuple[float, ...] = ()
    replica_rss_kib: tuple[int, ...] = ()
    replica_placed: tuple[int, ...] = ()
    moved: int = 0                   # placed on a replica other than the rendezvous owner

    @property
    def sustained(self) -> float:
        return self.placed_in_window / self.seconds

    @property
    def cpu_ms_per_admission(self) -> float:
        return self.sched_cpu_s * 1000 / self.placed if self.placed else math.nan

    @property
    def replica_cpu_ms_per_admission(self) -> tuple[float, ...]:
        """Each replica's CPU over all admissions (they add up to the sum)."""
        return tuple(c * 1000 / self.placed if self.placed else math.nan for c in self.replica_cpu_s)

    @property
    def sched_core_share(self) -> float:
        return self.sched_cpu_s / self.wall_s if self.wall_s > 0 else math.nan

    @property
    def sched_wait_share(self) -> float:
        return self.sched_waited_s / self.wall_s if self.wall_s > 0 else math.nan

    @property
    def driver_core_share(self) -> float:
        return self.driver_cpu_s / self.wall_s if self.wall_s > 0 else math.nan

    @property
    def carried(self) -> bool:
        return self.placed_in_window >= SUSTAINED_SHARE * self.sent and self.rejected == 0


def capacity(steps: Sequence[StepFigures], limit_ms: float | None = P99_LIMIT_MS) -> StepFigures | None:
    """The highest offered step carried with decision p99 <= limit_ms (None:
    whatever its latency -- the saturation throughput)."""
    good = [s for s in steps if s.carried and (limit_ms is None or s.p99_ms <= limit_ms)]
    return max(good, key=lambda s: s.offered, default=None)


TABLE_HEADER = ("| schedulers | engines | run | offered /s | sustained /s | p50 ms | p99 ms | sched hist p50 / p99 ms "
                "| sched CPU ms / adm | sched core | sched CPU wait | driver cores | engine msgs /s | sched RSS MiB "
                "| unplaced / rejected |\n"
                "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")


def _ms(value: float) -> str:
    if math.isnan(value):
        return "-"
    return "inf" if math.isinf(value) else f"{value:.2f}"


def replica_list(values: tuple[float, ...], fmt: str, sep: str = " / ") -> str:
    """Per-replica values in one cell: "0.31 / 0.30"."""
    return sep.join(format(v, fmt) for v in values)


def render_row(s: StepFigures, run: int = 1) -> str:
    """One step; several replicas: CPU per admission as "sum (each + ...)",
    RSS as "each / ..." (one replica: as ever)."""
    cpu, rss = _ms(s.cpu_ms_per_admission), f"{s.rss_kib / 1024:.0f}"
    if s.schedulers > 1 and s.replica_cpu_s:
        cpu += f" ({replica_list(s.replica_cpu_ms_per_admission, '.2f', ' + ')})"
        rss = replica_list(tuple(k / 1024 for k in s.replica_rss_kib), ".0f")
    return (f"| {s.schedulers} | {s.engines} | {run} | {s.offered:g} | {s.sustained:.0f} | {_ms(s.p50_ms)} | "
            f"{_ms(s.p99_ms)} | {_ms(s.hist_p50_ms)} / {_ms(s.hist_p99_ms)} | {cpu} | "
            f"{s.sched_core_share:.0%} | {s.sched_wait_share:.0%} | {s.driver_core_share:.2f} | "
            f"{s.engine_messages / s.wall_s:.0f} | {rss} | "
            f"{s.unplaced} / {s.rejected} |")


def render_table(runs: Sequence[tuple[int, Sequence[StepFigures]]]) -> str:
    """One table of (run number, its steps) pairs."""
    return "\n".join([TABLE_HEADER, *(render_row(s, run) for run, steps in runs for s in steps)])
