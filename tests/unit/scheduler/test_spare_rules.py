"""The warm-spare arithmetic (services/scheduler/spare_rules.py) on numbers alone."""

from __future__ import annotations

import math

import pytest

from services.scheduler.placement import PlacementRequest
from services.scheduler.spare_rules import ClassBacklog, Serving, calm, engine_order_key, predicted_first_token
from tests.unit.scheduler.helpers import engine_view

FALLBACK = 20_000.0
HEAD = PlacementRequest("r", "m", prompt_tokens=0, max_tokens=16, priority=0)


def _serving(n: int, service: float = 2.0, **view: object) -> list[Serving]:
    return [Serving(engine_view(f"e-{i}", **view), service) for i in range(n)]


def _backlog(waited: float = 0.0, ahead: int = 0, queued: int = 1) -> ClassBacklog:
    return ClassBacklog(0, waited, ahead, queued, HEAD)


@pytest.mark.parametrize(("backlog", "serving", "want"), [
    # idle engine, nothing ahead: the head's wait is all there is (no prefill, no step measured)
    (_backlog(waited=0.3), _serving(1), 0.3),
    # 8 slots / 2 s = 4 slots/s: 3 ahead of the head -> 0.75 s more
    (_backlog(waited=0.1, ahead=3), _serving(1, max_running=8), 0.85),
    # the tail: 9 queued, 8 ahead of it -> 2 s, later than the head's 0.1 s
    (_backlog(waited=0.1, queued=9), _serving(1, max_running=8), 2.0),
    # two engines free slots twice as fast
    (_backlog(queued=9), _serving(2, max_running=8), 1.0),
])
def test_predicted_first_token(backlog: ClassBacklog, serving: list[Serving], want: float) -> None:
    assert predicted_first_token(backlog, serving, FALLBACK) == pytest.approx(want)


def test_no_engine_serving_is_an_infinite_prediction() -> None:
    assert predicted_first_token(_backlog(), [], FALLBACK) == math.inf


def test_the_best_engine_counts_with_its_slot_wait_and_prefill() -> None:
    full = Serving(engine_view("e-0", queue_seconds=2.0), 2.0)     # 2 s of slot wait
    free = Serving(engine_view("e-1", prefill_tokens_per_second=1000.0, step_seconds=0.01), 2.0)
    head = PlacementRequest("r", "m", prompt_tokens=500, max_tokens=16, priority=0)
    got = predicted_first_token(ClassBacklog(0, 0.0, 0, 1, head), [full, free], FALLBACK)
    assert got == pytest.approx(0.5 + 0.01)                       # e-1: 500 tokens at 1,000/s + a step


@pytest.mark.parametrize(("leases", "queued", "utilization", "want"), [
    ([0, 0], 0, 0.5, True),
    ([2, 2], 0, 0.5, True),       # 4 <= 0.5 x 8 (all but the largest of two 8-slot engines)
    ([3, 2], 0, 0.5, False),
    ([0, 0], 1, 0.5, False),      # anything queued: not calm
    ([0], 0, 0.5, False),         # one engine: nothing to hold back
])
def test_calm(leases: list[int], queued: int, utilization: float, want: bool) -> None:
    serving = [Serving(engine_view(f"e-{i}", leases=n, max_running=8), 2.0) for i, n in enumerate(leases)]
    assert calm(serving, queued, utilization) is want


def test_engine_order_compares_numbers_as_numbers() -> None:
    ids = ["engine-10", "engine-2", "b-1", "engine-1", "a"]
    assert sorted(ids, key=engine_order_key) == ["a", "b-1", "engine-1", "engine-2", "engine-10"]
