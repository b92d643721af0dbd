"""Aging: a request moves up one class per threshold waited, repeatedly."""

from __future__ import annotations

import pytest

from services.scheduler.aging import AgingRule
from services.scheduler.events import RequestArrived, RequestDone, Tick
from services.scheduler.records import PlacedInfo, QueuedInfo

from .helpers import add_engine, admit, make_core, opts, report_load

RULE = AgingRule((0.0, 30.0, 30.0))


@pytest.mark.parametrize(
    ("base", "waited", "expected"),
    [
        (2, 0.0, 2), (2, 29.9, 2), (2, 30.0, 1), (2, 59.9, 1), (2, 60.0, 0), (2, 600.0, 0),
        (1, 29.9, 1), (1, 30.0, 0), (0, 1000.0, 0),
    ],
)
def test_class_at(base: int, waited: float, expected: int) -> None:
    assert RULE.class_at(base, 100.0, 100.0 + waited) == expected


def test_next_promotion_times() -> None:
    rule = AgingRule((0.0, 10.0, 20.0))
    assert rule.next_promotion(2, 0.0, 2) == 20.0
    assert rule.next_promotion(2, 0.0, 1) == 30.0
    assert rule.next_promotion(1, 0.0, 1) == 10.0
    assert rule.next_promotion(2, 0.0, 0) is None


def test_queue_promotes_on_time_and_repeatedly() -> None:
    core, clock = make_core()
    add_engine(core, "busy", report=False)  # registered, never reported: not placeable
    admit(core, opts("batch", priority=2))
    promotions = "kvmesh_scheduler_promotions_total"

    clock.advance(29.0)
    core.handle(Tick())
    assert dict(core.queued_updates())["batch"].priority == 2
    clock.advance(1.0)
    core.handle(Tick())
    assert dict(core.queued_updates())["batch"].priority == 1
    assert core.metrics.value(promotions, {"from_priority": "P2", "to_priority": "P1"}) == 1
    clock.advance(30.0)
    core.handle(Tick())
    assert dict(core.queued_updates())["batch"].priority == 0
    assert core.metrics.value(promotions, {"from_priority": "P1", "to_priority": "P0"}) == 1


def test_aged_request_overtakes_newer_higher_class() -> None:
    """A P2 request aged to P0 leaves before a P1 that arrived later."""
    core, clock = make_core(engine_queue_slack=0)
    token = add_engine(core, "e1", max_running=1, report=False)
    admit(core, opts("old-batch", tenant="a", priority=2))
    clock.advance(61.0)
    admit(core, opts("fresh-p1", tenant="b", priority=1))
    report_load(core, "e1", token)  # one slot: its first report places one
    assert core.request_state("old-batch").value == "placed"
    assert core.request_state("fresh-p1").value == "queued"


def test_readmitted_request_keeps_its_age() -> None:
    """arrival_unix from before a scheduler restart counts for aging."""
    core, clock = make_core()
    first = admit(core, opts("r", priority=2, arrival_unix=clock.wall() - 45.0))
    assert isinstance(first, QueuedInfo)
    assert first.priority == 1
    assert core.metrics.value(
        "kvmesh_scheduler_promotions_total", {"from_priority": "P2", "to_priority": "P1"}) == 1


def test_no_starvation_under_constant_p0_load() -> None:
    """Even with P0 work always waiting, a P2 request ages to P0 and then
    leaves before P0 requests that arrived after it."""
    core, clock = make_core(engine_queue_slack=0)
    token = add_engine(core, "e1", max_running=1)
    admit(core, opts("warm", tenant="a", priority=0))     # holds the one slot
    assert isinstance(admit(core, opts("batch", tenant="b", priority=2)), QueuedInfo)
    running = ["warm"]
    for second in range(80):
        notices = core.handle(RequestArrived(opts(f"chat-{second}", tenant="a", priority=0))).notices
        for rid in running:      # the engine finishes whatever it holds each second
            notices += core.handle(RequestDone(rid)).notices
        running = [rid for rid, notice in notices if isinstance(notice, PlacedInfo)]
        if "batch" in running:
            break
        clock.advance(1.0)
        report_load(core, "e1", token)   # a heartbeat: it changes no room, so no dispatch ...
        core.handle(Tick())              # ... the scheduler's tick (every 0.1 s) ages the queue
    assert "batch" in running
    assert second == 60          # P2 -> P1 at 30 s, P1 -> P0 at 60 s, then first by arrival
