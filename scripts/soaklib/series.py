"""What the soak measures of its long-lived processes: resident memory
(VmRSS) and open file descriptors, read from /proc every few seconds, one
series per process incarnation (a restarted service is a new process and
starts a new series), and the least-squares slope of each series after its
warm-up, judged against a bound per kind of service.

A series is judged once what is left of it after the warm-up spans at least
`min_span` seconds; shorter ones (a gateway killed again a few minutes
after its restart) are reported, not judged. The warm-up counts from the
later of the run's start and the series' own first sample: a fresh process
fills its caches, pools and arenas in its first minutes, which is growth, not
a leak.

Bounds (`BOUNDS`, per hour; see RELIABILITY.md "Soak" for the figures they
were set against): 20 MiB/h of RSS and 30 fds/h for every service. A leak
tied to traffic exceeds both by far: the soak sends ~10-20 requests a second,
so 1 KiB kept per request is 35-70 MiB/h, one socket or file kept per 100
requests 360+ fds/h. A leak tied to faults (a channel or a file kept per
engine restart or reconnect, ~40 faults an hour, each seen by every peer)
makes 40+ fds/h. Python's allocator and jemalloc (Redis, Envoy) settle a few
MiB above their first figure and stay there: flat within the bound once
warm.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

__all__ = ["BOUNDS", "Bound", "Sample", "Sampler", "Series", "Verdict", "judge", "read_proc", "role",
           "slope_per_hour"]


@dataclass(frozen=True)
class Bound:
    """Largest slope a flat process may show, per hour."""

    rss_mib: float
    fds: float


BOUNDS: dict[str, Bound] = {
    role: Bound(rss_mib=20.0, fds=30.0)
    for role in ("scheduler", "engine", "gateway", "batch", "envoy", "redis")
}


@dataclass(frozen=True)
class Sample:
    t: float        # seconds since the run began
    rss_mib: float
    fds: int


@dataclass
class Series:
    """One process incarnation's samples, in time order."""

    name: str
    pid: int
    samples: list[Sample] = field(default_factory=list)


@dataclass(frozen=True)
class Verdict:
    """One series' fit. `judged` false: too short after its warm-up to tell."""

    name: str
    pid: int
    first: float           # seconds since the run began
    last: float
    fit_from: float
    fitted: int            # samples in the fit
    rss_mib: tuple[float, float]   # first and last sample of the fit
    fds: tuple[int, int]
    rss_mib_per_hour: float
    fds_per_hour: float
    bound: Bound
    judged: bool

    @property
    def over(self) -> list[str]:
        """What exceeds its bound (empty when flat, or not judged)."""
        if not self.judged:
            return []
        out = []
        if self.rss_mib_per_hour > self.bound.rss_mib:
            out.append(f"RSS {self.rss_mib_per_hour:+.1f} MiB/h > {self.bound.rss_mib:g}")
        if self.fds_per_hour > self.bound.fds:
            out.append(f"fds {self.fds_per_hour:+.1f}/h > {self.bound.fds:g}")
        return out


def role(name: str) -> str:
    """engine-1 -> engine, gateway-0 -> gateway, scheduler -> scheduler."""
    return name.split("-", 1)[0]


def slope_per_hour(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, value) points, per hour; 0 for fewer
    than two distinct times."""
    if len(points) < 2:
        return 0.0
    mean_t = sum(t for t, _ in points) / len(points)
    mean_v = sum(v for _, v in points) / len(points)
    sxx = sum((t - mean_t) ** 2 for t, _ in points)
    if sxx == 0.0:
        return 0.0
    sxy = sum((t - mean_t) * (v - mean_v) for t, v in points)
    return sxy / sxx * 3600.0


def judge(series: Series, bound: Bound, warmup: float, min_span: float) -> Verdict:
    """Fit the series from the end of its warm-up on."""
    samples = series.samples
    fit_from = max(warmup, samples[0].t + warmup) if samples else warmup
    fitted = [s for s in samples if s.t >= fit_from]
    span = fitted[-1].t - fitted[0].t if fitted else 0.0
    return Verdict(
        name=series.name, pid=series.pid,
        first=samples[0].t if samples else 0.0, last=samples[-1].t if samples else 0.0, fit_from=fit_from,
        fitted=len(fitted),
        rss_mib=(fitted[0].rss_mib, fitted[-1].rss_mib) if fitted else (0.0, 0.0),
        fds=(fitted[0].fds, fitted[-1].fds) if fitted else (0, 0),
        rss_mib_per_hour=slope_per_hour([(s.t, s.rss_mib) for s in fitted]),
        fds_per_hour=slope_per_hour([(s.t, float(s.fds)) for s in fitted]),
        bound=bound, judged=len(fitted) >= 3 and span >= min_span,
    )


def read_proc(pid: int) -> tuple[float, int] | None:
    """(VmRSS in MiB, open fds) of a process; None once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as status:
            rss_kib = next((int(line.split()[1]) for line in status if line.startswith("VmRSS:")), None)
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except (OSError, ValueError):
        return None
    if rss_kib is None:   # a zombie: its memory is gone already
        return None
    return rss_kib / 1024.0, fds


class Sampler:
    """Series keyed by (name, pid): a new pid under a name is a new series."""

    def __init__(self, began: float) -> None:
        self.began = began
        self.series: dict[tuple[str, int], Series] = {}

    def sample(self, pids: dict[str, int]) -> None:
        now = time.monotonic() - self.began
        for name, pid in pids.items():
            read = read_proc(pid)
            if read is None:
                continue
            series = self.series.setdefault((name, pid), Series(name, pid))
            series.samples.append(Sample(now, read[0], read[1]))

    def verdicts(self, warmup: float, min_span: float) -> list[Verdict]:
        return [judge(s, BOUNDS[role(s.name)], warmup, min_span)
                for s in sorted(self.series.values(), key=lambda s: (s.name, s.samples[0].t))]
