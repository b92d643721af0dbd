"""Percentiles and the summary `kvmesh bench` reports.

Percentiles use linear interpolation between closest ranks (numpy's default
"linear" method, Hyndman & Fan type 7): p0 = min, p100 = max, and the p-th
percentile of [a, b] is a + (b - a) * p / 100.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["RequestResult", "percentile", "percentiles", "summarize", "class_label"]

PCTS = (50, 90, 99)


@dataclass
class RequestResult:
    """One HTTP request (one turn) as the client saw it. Times in seconds."""

    conversation: int
    turn: int
    priority: int | None
    group: int
    status: int = 0            # HTTP status; 0 = no response (transport error)
    ok: bool = False
    rejected: bool = False     # 429 / 503: the server said no (a clean answer, not a failure)
    error: str = ""
    start: float = 0.0         # when it was sent, seconds after the run's start
    lateness: float = 0.0      # open loop: sent this much after its scheduled time
    ttft: float | None = None  # first content chunk
    e2e: float | None = None   # last byte
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    chunks: int = 0
    max_tokens: int = 0
    chunk_gaps: list[float] = field(default_factory=list)
    # The chat sent (history included), for services/bench/floor.py's replay;
    # not written to JSON (report.py): a long context per request.
    messages: list[dict[str, str]] = field(default_factory=list, repr=False)

    @property
    def tpot(self) -> float | None:
        """Mean inter-token latency: (e2e - ttft) / (completion_tokens - 1)."""
        if self.ttft is None or self.e2e is None or self.completion_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.completion_tokens - 1)


def class_label(priority: int | None) -> str:
    return "default" if priority is None else f"P{priority}"


def percentile(values: Sequence[float], p: float) -> float:
    """The p-th percentile (0..100) of `values`, linear interpolation; NaN if empty."""
    if not 0 <= p <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {p}")
    data = sorted(values)
    if not data:
        return math.nan
    rank = (len(data) - 1) * p / 100.0
    lo = math.floor(rank)
    hi = min(lo + 1, len(data) - 1)
    return data[lo] + (data[hi] - data[lo]) * (rank - lo)


def percentiles(values: Iterable[float], pcts: Sequence[float] = PCTS) -> dict[str, float | None]:
    data = sorted(values)
    out: dict[str, float | None] = {}
    for p in pcts:
        value = percentile(data, p) if data else None
        out[f"p{p:g}"] = value
    out["mean"] = sum(data) / len(data) if data else None
    out["max"] = data[-1] if data else None
    return out


def _block(results: list[RequestResult], duration: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    out_tokens = sum(r.completion_tokens for r in ok)
    errors: dict[str, int] = {}
    rejections: dict[str, int] = {}  # why the server said no, as it said it
    for r in results:
        if not r.ok:
            counts = rejections if r.rejected else errors
            key = r.error[:120] or f"HTTP {r.status}"
            counts[key] = counts.get(key, 0) + 1
    return {
        "requests": len(results),
        "ok": len(ok),
        "rejected": sum(r.rejected for r in results),
        "failed": len(results) - len(ok) - sum(r.rejected for r in results),
        "errors": errors,
        "rejections": rejections,
        "ttft_s": percentiles(r.ttft for r in ok if r.ttft is not None),
        "itl_s": percentiles(t for t in (r.tpot for r in ok) if t is not None),
        "e2e_s": percentiles(r.e2e for r in ok if r.e2e is not None),
        "requests_per_s": len(ok) / duration if duration > 0 else None,
        "output_tokens_per_s": out_tokens / duration if duration > 0 else None,
        "total_tokens_per_s": (out_tokens + prompt) / duration if duration > 0 else None,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "completion_tokens": out_tokens,
        "prefix_hit_rate": cached / prompt if prompt else None,
        "client_lateness_s": percentiles(r.lateness for r in results),
    }


def summarize(results: list[RequestResult], duration: float) -> dict[str, Any]:
    """Overall figures plus the same per priority class ("P0".."P2", or
    "default" for requests sent without X-Priority)."""
    classes: dict[str, list[RequestResult]] = {}
    for r in results:
        classes.setdefault(class_label(r.priority), []).append(r)
    return {
        "duration_s": duration,
        "overall": _block(results, duration),
        "classes": {name: _block(rs, duration) for name, rs in sorted(classes.items())},
    }
