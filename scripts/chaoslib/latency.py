"""First-token times per priority class of a chaos run (`Tally.ttft`), and
the comparison of a run with faults against its paired run without them
(`chaos.py --paired`): the P0 p99 ratio is the figure issue 27 bounds
(within 1.5x of the same load without kills)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .outcomes import Tally

__all__ = ["ClassTtft", "class_ttft", "compare_lines", "percentile", "ttft_lines"]


def percentile(values: list[float], q: float) -> float | None:
    """The nearest-rank `q`-th percentile (q in [0, 100]); None for no values.
    Nearest rank, not interpolated: p99 of 300 samples is the 297th, a time
    some request really waited."""
    if not values:
        return None
    ranked = sorted(values)
    return ranked[max(0, math.ceil(q / 100 * len(ranked)) - 1)]


@dataclass(frozen=True)
class ClassTtft:
    label: str
    count: int
    p50: float | None
    p99: float | None
    worst: float | None


def class_ttft(tally: Tally) -> list[ClassTtft]:
    """Each class's first-token figures, P0 first."""
    return [ClassTtft(label, len(v), percentile(v, 50), percentile(v, 99), max(v) if v else None)
            for label, v in sorted(tally.ttft.items())]


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f} ms"


def ttft_lines(tally: Tally) -> list[str]:
    """One line per class: completed requests, TTFT p50 / p99 / worst."""
    return [f"TTFT {c.label}: {c.count} completed, p50 {_ms(c.p50)}, p99 {_ms(c.p99)}, worst {_ms(c.worst)}"
            for c in class_ttft(tally)]


def ratio(chaos: float | None, base: float | None) -> float | None:
    """chaos / base, None when either is missing or the base is 0."""
    if chaos is None or not base:
        return None
    return chaos / base


def compare_lines(base: Tally, chaos: Tally, label: str = "P0") -> list[str]:
    """The paired comparison: each run's lost and refused counts and the
    class's TTFT p99 without and with faults, and their ratio."""
    b = percentile(base.ttft.get(label, []), 99)
    c = percentile(chaos.ttft.get(label, []), 99)
    r = ratio(c, b)
    lost = (sum(base.lost.values()), sum(chaos.lost.values()))
    refused = (sum(base.rejected.values()), sum(chaos.rejected.values()))
    return [
        f"paired: without faults sent {base.sent}, lost {lost[0]}, refused {refused[0]}; "
        f"with faults sent {chaos.sent}, lost {lost[1]}, refused {refused[1]}",
        f"paired: {label} TTFT p99 without faults {_ms(b)}, with faults {_ms(c)}, ratio "
        + ("-" if r is None else f"{r:.2f}x"),
    ]
