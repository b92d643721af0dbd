"""The driver's stall watch (services/gateway/stall_watch.py): first-token and
stall deadlines, the clock held while relaying and stopped while the request
is off any engine (requeued, moving) -- on a fake clock."""

from __future__ import annotations

import asyncio
import math

import pytest

from services.common.clock import FakeClock, SystemClock
from services.common.proto.kvmesh.v1 import scheduler_pb2
from services.gateway.stall_watch import (
    GAP_SAMPLES,
    GapSample,
    GenerationLimit,
    ProgressWatch,
    StallLimits,
    StallTimer,
)

LIMITS = StallLimits(first_token_seconds=10.0, token_stall_seconds=2.0, token_stall_p95_seconds=0.5)


def test_limits_come_from_placed_or_none() -> None:
    assert StallLimits.from_placed(scheduler_pb2.Placed(engine_id="e")) is None
    placed = scheduler_pb2.Placed(first_token_seconds=10, token_stall_seconds=2, token_stall_p95_seconds=0.5)
    assert StallLimits.from_placed(placed) == LIMITS


def test_first_token_then_stall_deadline() -> None:
    watch = ProgressWatch()
    watch.start(LIMITS, 100.0)
    assert watch.overdue(109.9) is None
    assert "no first token within 10s" in (watch.overdue(110.0) or "")
    watch.delta(105.0)                       # first token: no gap sampled
    watch.waiting(105.0)
    assert watch.sample.seen == 0
    assert watch.overdue(106.9) is None
    reason = watch.overdue(107.0)
    assert reason is not None and "past the stall deadline 2s" in reason and "p95 gap 0.5s" in reason


def test_clock_holds_while_relaying_to_a_slow_client() -> None:
    watch = ProgressWatch()
    watch.start(LIMITS, 0.0)
    watch.delta(1.0)
    assert watch.overdue(50.0) is None       # emit blocked 49 s on the client: no stall
    watch.waiting(50.0)
    assert watch.overdue(51.9) is None and watch.overdue(52.0) is not None


def test_watch_stops_while_requeued_and_restarts_on_the_next_engine() -> None:
    clock = FakeClock()
    watch = ProgressWatch()
    watch.start(LIMITS, clock.monotonic())
    watch.delta(clock.monotonic())
    watch.waiting(clock.monotonic())
    watch.stop()                              # preempted: requeued, waiting for a placement
    clock.advance(600.0)
    assert watch.overdue(clock.monotonic()) is None and watch.due_at() is None
    watch.start(LIMITS, clock.monotonic())    # placed again: the first-token deadline from now
    clock.advance(9.0)
    assert watch.overdue(clock.monotonic()) is None
    clock.advance(1.0)
    assert watch.overdue(clock.monotonic()) is not None


def test_each_stall_doubles_the_limits_on_the_next_engine() -> None:
    watch = ProgressWatch()
    watch.start(LIMITS, 0.0)
    watch.delta(1.0)
    watch.waiting(1.0)
    assert watch.overdue(3.0) is not None    # 2 s stall limit
    watch.stalled()
    watch.stop()
    watch.start(LIMITS, 10.0)                # the next engine
    assert watch.overdue(29.9) is None and watch.overdue(30.0) is not None   # first token: 2 x 10 s
    watch.delta(30.0)
    watch.waiting(30.0)
    assert watch.overdue(33.9) is None and watch.overdue(34.0) is not None   # stall: 2 x 2 s


def test_no_limits_means_no_watch() -> None:
    watch = ProgressWatch()
    watch.start(None, 0.0)
    assert watch.overdue(1e9) is None and watch.due_at() is None


def test_gap_sample_keeps_at_most_16_and_the_max() -> None:
    sample = GapSample()
    for i in range(1000):
        sample.add(i / 1000)
    assert len(sample.gaps) == GAP_SAMPLES and sample.seen == 1000 and sample.max_gap == 0.999
    # A reservoir: not just the first 16.
    assert max(sample.gaps) > GAP_SAMPLES / 1000


def test_gaps_are_the_waits_for_the_engine() -> None:
    watch = ProgressWatch()
    watch.start(LIMITS, 0.0)
    for t in (1.0, 1.5, 2.5):
        watch.delta(t)
        watch.waiting(t + 0.1)               # 0.1 s relaying each time: not part of the gap
    assert watch.sample.gaps == pytest.approx([0.4, 0.9])


def test_timer_calls_on_stall_once_after_the_deadline_and_not_while_progressing() -> None:
    async def scenario() -> tuple[list[str], list[str], float]:
        clock = SystemClock()
        stalled: list[str] = []
        tripped = asyncio.Event()
        watch = ProgressWatch()
        watch.start(StallLimits(1.0, 1.0), clock.monotonic())
        timer = StallTimer(watch, clock, lambda reason: (stalled.append(reason), tripped.set()))  # type: ignore[arg-type, func-returns-value]  # a lambda making two calls; the timer drops the tuple
        timer.arm()
        for _ in range(15):                   # a delta every 0.1 s for 1.5 s > the limit: no stall
            await asyncio.sleep(0.1)
            watch.delta(clock.monotonic())
            watch.waiting(clock.monotonic())
        progressing, silent_from = list(stalled), clock.monotonic()
        await asyncio.wait_for(tripped.wait(), 30.0)
        waited = clock.monotonic() - silent_from
        await asyncio.sleep(0.2)
        timer.cancel()
        return progressing, stalled, waited

    progressing, stalled, waited = asyncio.run(scenario())
    assert progressing == []
    assert len(stalled) == 1 and "past the stall deadline" in stalled[0]
    assert waited >= 1.0


def test_timer_watches_the_stall_limit_from_the_first_token_not_the_first_token_limit() -> None:
    """A long first-token limit (30 s) must not delay the check of a short
    stall limit once the first token came (the timer was armed for 30 s)."""
    async def scenario() -> float:
        clock = SystemClock()
        tripped = asyncio.Event()
        watch = ProgressWatch()
        watch.start(StallLimits(30.0, 0.5), clock.monotonic())
        timer = StallTimer(watch, clock, lambda _reason: tripped.set())
        timer.arm()
        await asyncio.sleep(0.05)
        watch.delta(clock.monotonic())        # the first token; then silence
        watch.waiting(clock.monotonic())
        silent_from = clock.monotonic()
        await asyncio.wait_for(tripped.wait(), 20.0)
        timer.cancel()
        return clock.monotonic() - silent_from

    waited = asyncio.run(scenario())
    assert 0.5 <= waited < 10.0, waited


def test_generation_limit_the_earlier_limit_wins_and_names_itself() -> None:
    limit = GenerationLimit.starting(cap_seconds=120.0, derived_seconds=30.0, now=100.0)
    assert (limit.at, limit.seconds) == (130.0, 30.0)
    capped = GenerationLimit.starting(cap_seconds=10.0, derived_seconds=30.0, now=100.0)
    assert (capped.at, capped.seconds) == (110.0, 10.0)


def test_generation_limit_without_a_derived_limit_is_the_cap() -> None:
    limit = GenerationLimit.starting(cap_seconds=120.0, derived_seconds=0.0, now=5.0)
    assert limit.derived_at == math.inf
    assert (limit.at, limit.seconds) == (125.0, 120.0)


def test_generation_limit_a_wait_off_engine_moves_only_the_derived_limit() -> None:
    limit = GenerationLimit.starting(cap_seconds=120.0, derived_seconds=30.0, now=0.0)
    limit.off_engine(50.0)
    assert (limit.derived_at, limit.cap_at) == (80.0, 120.0)
    limit.off_engine(60.0)  # now the cap is the earlier one: it counts every wait
    assert (limit.at, limit.seconds) == (120.0, 120.0)
