"""A Prometheus histogram read from /metrics text: cumulative bucket counts,
the difference of two scrapes, and a quantile estimated the way PromQL's
histogram_quantile does (linear within the bucket)."""

from __future__ import annotations

import math
import re

__all__ = ["bucket_delta", "bucket_quantile", "histogram_buckets"]

_LE = re.compile(r'le="([^"]+)"')


def histogram_buckets(text: str, name: str) -> dict[float, float]:
    """upper bound -> cumulative count of `name`, summed over its label sets."""
    out: dict[float, float] = {}
    prefix = name + "_bucket{"
    for line in text.splitlines():
        if not line.startswith(prefix):
            continue
        labels, _, value = line.rpartition("} ")
        match = _LE.search(labels)
        if match is None:
            continue
        bound = math.inf if match.group(1) == "+Inf" else float(match.group(1))
        out[bound] = out.get(bound, 0.0) + float(value.split()[0])
    return out


def bucket_delta(after: dict[float, float], before: dict[float, float]) -> dict[float, float]:
    """What was observed between two scrapes."""
    return {bound: count - before.get(bound, 0.0) for bound, count in after.items()}


def bucket_quantile(buckets: dict[float, float], q: float) -> float:
    """The q-quantile (0..1) of cumulative `buckets`; NaN without
    observations; infinite when it falls past the last finite bound."""
    if not 0 <= q <= 1:
        raise ValueError(f"q must be in [0, 1], got {q}")
    bounds = sorted(buckets)
    total = buckets[bounds[-1]] if bounds else 0.0
    if total <= 0:
        return math.nan
    rank = q * total
    lower, below = 0.0, 0.0
    for bound in bounds:
        count = buckets[bound]
        if count >= rank:
            if math.isinf(bound):
                return math.inf
            if count == below:
                return bound
            return lower + (bound - lower) * (rank - below) / (count - below)
        lower, below = bound, count
    return lower
