"""A sliding window of latency samples and its p95.

Bounded both ways: at most `max_samples` (the oldest drops out) and only
those of the last `max_age_seconds` (pruned when read or added). Pure: fed
times by its caller, so it is tested on a fake clock.

The p95 is the nearest-rank one (the ceil(0.95 n)-th smallest sample: an
actual observed value, never interpolated past the largest), sorted again
only when the window changed since the last read -- and, with
`max_staleness_seconds`, at most that often (the scheduler asks at every
placement; a p95 a quarter second old is as good, and a busy window is not
sorted a thousand times a second).
"""

from __future__ import annotations

import math
from collections import deque

__all__ = ["P95", "LatencyWindow"]

P95 = 0.95


class LatencyWindow:
    def __init__(self, max_samples: int, max_age_seconds: float, max_staleness_seconds: float = 0.0) -> None:
        self._max_age = max_age_seconds
        self._staleness = max_staleness_seconds
        self._samples: deque[tuple[float, float]] = deque(maxlen=max_samples)  # (at, value)
        self._sorted: list[float] | None = None
        self._stale = True           # samples changed since `_sorted` was made
        self._sorted_at = 0.0

    def add(self, value: float, now: float) -> None:
        self._samples.append((now, max(0.0, value)))
        self._prune(now)
        self._stale = True

    def _prune(self, now: float) -> None:
        horizon = now - self._max_age
        dropped = False
        while self._samples and self._samples[0][0] < horizon:
            self._samples.popleft()
            dropped = True
        if dropped:
            self._stale = True

    def count(self, now: float) -> int:
        self._prune(now)
        return len(self._samples)

    def quantile(self, q: float, now: float) -> float | None:
        """The nearest-rank `q` quantile of the window; None when empty."""
        self._prune(now)
        if not self._samples:
            return None
        if self._sorted is None or (self._stale and now - self._sorted_at >= self._staleness):
            self._sorted, self._stale, self._sorted_at = sorted(v for _, v in self._samples), False, now
        ordered = self._sorted
        return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]

    def p95(self, now: float) -> float | None:
        return self.quantile(P95, now)
