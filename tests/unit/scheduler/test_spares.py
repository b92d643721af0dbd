"""Warm spares (services/scheduler/spares.py) on a fake clock: which engine is
held, when a spare is promoted, when an engine returns, and that placement
never sees a spare."""

from __future__ import annotations

from typing import Any

from services.common.clock import FakeClock
from services.common.config import SparesConfig
from services.scheduler.core import SchedulerCore
from services.scheduler.events import EngineLeft, RequestArrived, RequestDone, Tick
from services.scheduler.spare_rules import engine_order_key
from tests.unit.scheduler.helpers import add_engine, make_core, opts, placed_engine


def _core(spares: int = 1, **spare_kw: Any) -> tuple[SchedulerCore, FakeClock]:
    """One model, lease slots = max_running (no slack, no P0 reserve, no
    preemption): a second request on a full engine waits in the queue."""
    return make_core(spares=SparesConfig(count=spares, **spare_kw), engine_queue_slack=0, p0_reserved_leases=0,
                     preempt_classes=[], stale_report_seconds=1e6)


def _tick(core: SchedulerCore, clock: FakeClock, seconds: float) -> list:
    clock.advance(seconds)
    return core.handle(Tick()).notices


def _spares(core: SchedulerCore) -> set[str]:
    return {s.view.engine_id for s in core.state().engines if s.spare}


def _arrive(core: SchedulerCore, request_id: str, priority: int) -> list:
    return core.handle(RequestArrived(opts(request_id, priority=priority))).notices


def _join(core: SchedulerCore, engine_id: str, **kw: Any) -> int:
    """An engine joins and reports; the next housekeeping tick settles the spares."""
    token = add_engine(core, engine_id, **kw)
    core.handle(Tick())
    return token


def _two(core: SchedulerCore, max_running: int = 1) -> dict[str, int]:
    return {e: _join(core, e, max_running=max_running) for e in ("e-0", "e-1")}


def test_one_engine_serves_the_rest_are_spares_last_in_order() -> None:
    core, _ = _core(spares=1)
    _join(core, "e-10")
    assert _spares(core) == set()            # a lone engine always serves
    _join(core, "e-2")
    assert _spares(core) == {"e-10"}         # numbers ordered as numbers: e-2 < e-10
    assert core.metrics.engines.labels("spare")._value.get() in (0, 1)


def test_replicas_agree_whatever_the_join_order() -> None:
    ids = ["e-1", "e-2", "e-10"]
    sets = []
    for joins in (ids, list(reversed(ids)), ["e-2", "e-10", "e-1"]):
        core, _ = _core(spares=1)
        for e in joins:
            _join(core, e)
        sets.append(_spares(core))
    assert sets == [{"e-10"}] * 3
    assert sorted(ids, key=engine_order_key) == ["e-1", "e-2", "e-10"]


def test_placement_never_uses_a_spare() -> None:
    core, _ = _core(spares=1)
    _two(core, max_running=4)
    for i in range(4):
        assert placed_engine(_arrive(core, f"r{i}", 2), f"r{i}") == "e-0"   # P2: no target, no promotion
    out = _arrive(core, "r4", 2)
    assert placed_engine(out, "r4") is None and core.queued_total() == 1
    assert _spares(core) == {"e-1"}


def test_a_queued_p0_that_would_miss_promotes_a_spare_at_once() -> None:
    core, _ = _core(spares=1)
    _two(core)
    assert placed_engine(_arrive(core, "r1", 1), "r1") == "e-0"
    out = _arrive(core, "p0", 0)               # e-0 full: predicted slot wait 2 s > P0's 0.5 s
    assert placed_engine(out, "p0") == "e-1"   # promoted and placed in the same event
    assert _spares(core) == set()
    assert core.metrics.spare_promotions.labels("m", "slo")._value.get() == 1
    assert core.metrics.spare_promotion_seconds._sum.get() == 0.0   # same event: a state change


def test_p2_backlog_alone_does_not_promote_unless_configured() -> None:
    core, clock = _core(spares=1)
    _two(core)
    _arrive(core, "r1", 2)
    _arrive(core, "r2", 2)
    for _ in range(20):
        _tick(core, clock, 1.0)
    assert _spares(core) == {"e-1"} and core.queued_total() == 1
    core, _ = _core(spares=1, ttft_target_seconds=[0.5, 2.0, 1.0])
    _two(core)
    _arrive(core, "r1", 2)
    assert placed_engine(_arrive(core, "r2", 2), "r2") == "e-1"


def test_promote_hold_waits_for_a_lasting_miss() -> None:
    core, clock = _core(spares=1, promote_hold_seconds=2.0)
    _two(core)
    _arrive(core, "r1", 1)
    assert placed_engine(_arrive(core, "p0", 0), "p0") is None
    assert placed_engine(_tick(core, clock, 1.0), "p0") is None
    assert placed_engine(_tick(core, clock, 1.5), "p0") == "e-1"


def _done(core: SchedulerCore, request_id: str) -> None:
    core.handle(RequestDone(request_id))


def test_an_idle_engine_returns_after_calm_and_hysteresis_prevents_flapping() -> None:
    core, clock = _core(spares=1, demote_hold_seconds=30.0)
    _two(core, max_running=2)
    _arrive(core, "a", 1), _arrive(core, "b", 1)
    assert placed_engine(_arrive(core, "p0", 0), "p0") == "e-1"      # promoted
    for rid in ("a", "b", "p0"):
        _done(core, rid)
    _tick(core, clock, 1.0)                   # calm from now
    _tick(core, clock, 20.0)
    _arrive(core, "c", 1), _arrive(core, "d", 1), _arrive(core, "e", 1)   # 3 leases > 0.5 x 2: not calm
    _tick(core, clock, 1.0)
    for rid in ("c", "d", "e"):
        _done(core, rid)
    _tick(core, clock, 1.0)                   # calm again from here
    _tick(core, clock, 25.0)
    assert _spares(core) == set()             # 25 s of calm < 30 s: still serving
    _tick(core, clock, 6.0)
    assert _spares(core) == {"e-1"}           # back to spare, the last in order
    assert core.metrics.spare_returns.labels("m")._value.get() == 2   # start-up, then this


def test_an_engine_holding_leases_is_never_returned() -> None:
    core, clock = _core(spares=1, demote_hold_seconds=5.0, demote_below_utilization=1.0)
    _two(core, max_running=2)
    _arrive(core, "a", 1), _arrive(core, "b", 1)
    assert placed_engine(_arrive(core, "p0", 0), "p0") == "e-1"
    _done(core, "a")
    _done(core, "b")                          # e-0 idle, e-1 holds p0's lease
    for _ in range(10):
        _tick(core, clock, 1.0)
    assert _spares(core) == {"e-0"}           # the idle one returned; e-1 keeps serving p0
    assert core.lease_holder("p0") == "e-1"
    core2, clock2 = _core(spares=1, demote_hold_seconds=5.0, demote_below_utilization=1.0)
    _two(core2, max_running=2)
    _arrive(core2, "a", 1), _arrive(core2, "b", 1)
    _arrive(core2, "p0", 0)
    _done(core2, "b")                         # both hold a lease: calm, yet nothing returns
    for _ in range(10):
        _tick(core2, clock2, 1.0)
    assert _spares(core2) == set()


def test_a_serving_engine_leaving_promotes_the_spare() -> None:
    core, _ = _core(spares=1)
    tokens = _two(core)
    core.handle(EngineLeft("e-0", tokens["e-0"]))
    assert _spares(core) == set()
    assert core.metrics.spare_promotions.labels("m", "fleet")._value.get() == 1
    assert placed_engine(_arrive(core, "r", 0), "r") == "e-1"


def test_no_spares_configured_changes_nothing() -> None:
    core, _ = make_core()
    for e in ("e-0", "e-1"):
        _join(core, e)
    assert _spares(core) == set()
    assert core.metrics.engines.labels("spare")._value.get() == 0


def test_an_engine_not_serving_yet_is_no_reason_to_hold_the_serving_one() -> None:
    core, _ = _core(spares=1)
    _join(core, "e-0", serving=False)    # registered, still warming up
    _join(core, "e-1")
    assert _spares(core) == {"e-0"}           # the serving one serves, whatever the order
    assert placed_engine(_arrive(core, "r", 2), "r") == "e-1"
