"""The steps of offered load and the open-loop arrival times within one.

Open loop: arrivals follow the clock, never the answers, so a slow scheduler
shows as latency and a backlog instead of as a lower offered rate.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

__all__ = ["FleetRun", "arrival_offsets", "fleet_plan", "split_rate", "step_rates"]


@dataclass(frozen=True)
class FleetRun:
    """One measured fleet: its engines, scheduler replicas, and run number (from 1)."""

    engines: int
    schedulers: int
    run: int


def fleet_plan(engines: list[int], schedulers: list[int], repeat: int = 1) -> list[FleetRun]:
    """Every (engines, schedulers) in the order given, engines outermost,
    each `repeat` times in a row: a fleet's scheduler counts measured side
    by side, under the machine's same conditions."""
    if repeat < 1 or not engines or not schedulers or min(engines) < 1 or min(schedulers) < 1:
        raise ValueError(f"need engines, schedulers and repeat >= 1, got {engines}, {schedulers}, {repeat}")
    return [FleetRun(e, n, run) for e in engines for n in schedulers for run in range(1, repeat + 1)]


def step_rates(start: float, maximum: float, factor: float = 2.0) -> list[float]:
    """start, start x factor, ... while <= maximum (always at least `start`)."""
    if start <= 0 or factor <= 1:
        raise ValueError(f"start must be > 0 and factor > 1, got {start}, {factor}")
    rates = [start]
    while rates[-1] * factor <= maximum * (1 + 1e-9):
        rates.append(rates[-1] * factor)
    return rates


def split_rate(rate: float, workers: int) -> list[float]:
    """The share of `rate` each of `workers` synthetic gateways offers."""
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    return [rate / workers] * workers


def arrival_offsets(rate: float, seconds: float, seed: int) -> list[float]:
    """Poisson arrival times in [0, seconds) at `rate` per second (seeded:
    every run of a step offers the same instants)."""
    if rate <= 0 or seconds <= 0:
        return []
    rng = random.Random(seed)
    out: list[float] = []
    t = rng.expovariate(rate)
    while t < seconds:
        out.append(t)
        t += rng.expovariate(rate)
    return out
