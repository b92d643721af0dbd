"""Percentile math and the summary's arithmetic."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.bench.stats import RequestResult, percentile, summarize


def test_percentile_known_values() -> None:
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([10.0], 99) == 10.0
    assert percentile([3.0, 1.0, 2.0], 0) == 1.0 and percentile([3.0, 1.0, 2.0], 100) == 3.0
    assert percentile(list(range(101)), 90) == 90.0
    assert percentile([0.0, 10.0], 99) == pytest.approx(9.9)
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError):
        percentile([1.0], 101)


@given(st.lists(st.floats(-1e6, 1e6), min_size=1, max_size=200), st.floats(0, 100))
def test_percentile_matches_numpy_linear(values: list[float], p: float) -> None:
    assert percentile(values, p) == pytest.approx(float(np.percentile(values, p)), rel=1e-9, abs=1e-6)


def _ok(conv: int, priority: int | None, ttft: float, e2e: float, out: int, prompt: int, cached: int) -> RequestResult:
    return RequestResult(conv, 0, priority, 0, status=200, ok=True, ttft=ttft, e2e=e2e,
                         completion_tokens=out, prompt_tokens=prompt, cached_tokens=cached)


def test_summary_per_class_throughput_hit_rate_and_rejections() -> None:
    results = [
        _ok(0, 0, 0.1, 1.1, 11, 100, 80),
        _ok(1, 0, 0.3, 1.3, 11, 100, 0),
        _ok(2, 2, 0.5, 2.5, 21, 200, 200),
        RequestResult(3, 0, 2, 0, status=429, rejected=True, error="HTTP 429"),
        RequestResult(4, 0, 2, 0, status=500, error="HTTP 500: boom"),
    ]
    s = summarize(results, duration=2.0)
    o = s["overall"]
    assert (o["requests"], o["ok"], o["rejected"], o["failed"]) == (5, 3, 1, 1)
    assert o["errors"] == {"HTTP 500: boom": 1}
    assert o["requests_per_s"] == 1.5 and o["output_tokens_per_s"] == 21.5
    assert o["prefix_hit_rate"] == pytest.approx(280 / 400)
    assert o["ttft_s"]["p50"] == pytest.approx(0.3)
    # Mean inter-token time: (e2e - ttft) / (out - 1) = 0.1 s for each.
    assert o["itl_s"]["p99"] == pytest.approx(0.1)
    p0, p2 = s["classes"]["P0"], s["classes"]["P2"]
    assert p0["ok"] == 2 and p0["ttft_s"]["p50"] == pytest.approx(0.2)
    assert (p2["ok"], p2["rejected"], p2["failed"]) == (1, 1, 1) and p2["prefix_hit_rate"] == 1.0
