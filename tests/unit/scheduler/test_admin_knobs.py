"""The operator's knobs in the core (admin_knobs.py), on a fake clock:
pause / resume a class (and the aging rule while paused), drain / undrain
an engine, switch the placement policy."""

from __future__ import annotations

import pytest

from services.common.config import ConfigError
from services.scheduler.events import (
    ClassPaused,
    EngineCommand,
    EngineDrainSet,
    EngineLeft,
    PolicyChosen,
    RequestDone,
    StreamClosed,
    Tick,
)
from services.scheduler.records import PlacedInfo, QueuedInfo, RejectedInfo, RejectReason, RequestState

from .helpers import add_engine, admit, make_core, opts

PAUSED = "kvmesh_scheduler_admissions_paused"


def test_paused_class_stays_queued_while_others_run_then_resumes() -> None:
    core, _clock = make_core()
    assert core.metrics.value(PAUSED, {"priority": "P2"}) == 0     # the series exists from the start
    core.handle(ClassPaused(2, True))
    assert core.metrics.value(PAUSED, {"priority": "P2"}) == 1
    add_engine(core, "e1")
    assert isinstance(admit(core, opts("batch", priority=2)), QueuedInfo)
    assert isinstance(admit(core, opts("chat", priority=0)), QueuedInfo)
    assert core.request_state("chat") is RequestState.PLACED      # P0 goes past the paused P2
    assert core.request_state("batch") is RequestState.QUEUED
    core.handle(Tick())
    assert core.request_state("batch") is RequestState.QUEUED
    assert core.state().paused == [2]

    outbox = core.handle(ClassPaused(2, False))                   # resuming dispatches at once
    assert [(rid, type(n)) for rid, n in outbox.notices] == [("batch", PlacedInfo)]
    assert core.metrics.value(PAUSED, {"priority": "P2"}) == 0 and core.state().paused == []


def test_a_paused_class_does_not_block_the_classes_below_it() -> None:
    core, _ = make_core()
    core.handle(ClassPaused(0, True))
    add_engine(core, "e1")
    admit(core, opts("p0", priority=0))
    admit(core, opts("p1", priority=1))
    assert core.request_state("p0") is RequestState.QUEUED
    assert core.request_state("p1") is RequestState.PLACED


def test_no_request_ages_out_of_a_paused_class_and_aging_catches_up_on_resume() -> None:
    """Aging 30 s per class: a P2 waiting 70 s in a paused P2 is still P2 (it
    would be P0 without the pause, and P0 is not paused: the pause would be
    defeated); on resume it takes the class its wait gives it."""
    core, clock = make_core()
    add_engine(core, "busy", report=False)                        # nothing placeable
    core.handle(ClassPaused(2, True))
    admit(core, opts("batch", priority=2))
    for _ in range(7):
        clock.advance(10.0)
        core.handle(Tick())
    assert dict(core.queued_updates())["batch"].priority == 2
    promotions = "kvmesh_scheduler_promotions_total"
    assert core.metrics.value(promotions, {"from_priority": "P2", "to_priority": "P1"}) == 0
    core.handle(ClassPaused(2, False))
    assert dict(core.queued_updates())["batch"].priority == 0
    assert core.metrics.value(promotions, {"from_priority": "P2", "to_priority": "P1"}) == 1
    assert core.metrics.value(promotions, {"from_priority": "P1", "to_priority": "P0"}) == 1


def test_requests_age_into_a_paused_class_and_wait_there() -> None:
    core, clock = make_core()
    core.handle(ClassPaused(1, True))
    add_engine(core, "busy", report=False)
    admit(core, opts("batch", priority=2))
    clock.advance(31.0)
    core.handle(Tick())
    assert dict(core.queued_updates())["batch"].priority == 1     # P2 -> P1, and held there
    clock.advance(60.0)
    core.handle(Tick())
    assert dict(core.queued_updates())["batch"].priority == 1


def test_a_paused_class_admits_within_its_cap_and_expires_at_its_ttl() -> None:
    core, clock = make_core(queue_caps=[10, 10, 1], queue_ttl_seconds=[60.0, 300.0, 100.0])
    add_engine(core, "e1")
    core.handle(ClassPaused(2, True))
    assert isinstance(admit(core, opts("a", priority=2)), QueuedInfo)
    refused = admit(core, opts("b", priority=2, tenant="u"))
    assert isinstance(refused, RejectedInfo) and refused.reason is RejectReason.QUEUE_FULL
    clock.advance(101.0)
    outbox = core.handle(Tick())
    (rid, notice), = outbox.notices
    assert rid == "a" and isinstance(notice, RejectedInfo) and notice.reason is RejectReason.EXPIRED


def test_pause_of_an_unknown_class_is_refused() -> None:
    core, _ = make_core()
    with pytest.raises(ValueError, match="priority must be"):
        core.handle(ClassPaused(3, True))


def test_a_drained_engine_gets_no_new_requests_until_undrained() -> None:
    core, _ = make_core(policy="round_robin")
    add_engine(core, "e1")
    add_engine(core, "e2")
    outbox = core.handle(EngineDrainSet("e1", True))
    assert outbox.commands == []                                  # no --move: the engine is not told
    engines = []
    for i in range(4):
        admit(core, opts(f"r{i}"))
        engines.append(core.lease_of(f"r{i}").engine_id)
        core.handle(RequestDone(f"r{i}", False))
    assert engines == ["e2"] * 4
    state = {e.view.engine_id: e.view.draining for e in core.state().engines}
    assert state == {"e1": True, "e2": False} and core.state().drained == ["e1"]

    outbox = core.handle(EngineDrainSet("e1", False))
    assert outbox.commands == [("e1", EngineCommand.UNDRAIN)]
    for i in range(4, 8):
        admit(core, opts(f"r{i}"))
        engines.append(core.lease_of(f"r{i}").engine_id)
        core.handle(RequestDone(f"r{i}", False))
    assert "e1" in engines[4:]


def test_drain_with_move_tells_the_engine_and_survives_a_reconnect() -> None:
    core, _ = make_core()
    token = add_engine(core, "e1")
    outbox = core.handle(EngineDrainSet("e1", True, move=True))
    assert outbox.commands == [("e1", EngineCommand.MOVE_AWAY)]
    core.handle(EngineLeft("e1", token))
    add_engine(core, "e1")                                        # back: still drained
    admit(core, opts("r"))
    assert core.request_state("r") is RequestState.QUEUED
    core.handle(EngineDrainSet("e1", False))
    assert core.request_state("r") is RequestState.PLACED


def test_policy_switch_takes_effect_for_the_next_placement() -> None:
    core, _ = make_core()
    add_engine(core, "e1")
    admit(core, opts("a"))
    assert "round_robin" in core.policy_names() and "least_load" in core.policy_names()
    core.handle(PolicyChosen("round_robin"))
    admit(core, opts("b"))
    placements = "kvmesh_scheduler_placements_total"
    assert core.state().policy == "round_robin"
    assert core.metrics.value(placements, {"policy": "predicted_ttft", "kind": "cold"}) == 1
    assert core.metrics.value(placements, {"policy": "round_robin", "kind": "cold"}) == 1
    with pytest.raises(ConfigError, match="unknown policy 'nope'"):
        core.handle(PolicyChosen("nope"))
    assert core.state().policy == "round_robin"


def test_held_promotions_of_withdrawn_requests_do_not_pile_up_while_paused() -> None:
    """Requests that leave a paused class (cancelled here) take their held
    promotions with them: memory follows the live queue, not its history."""
    core, clock = make_core()
    add_engine(core, "busy", report=False)
    core.handle(ClassPaused(2, True))
    for i in range(300):
        admit(core, opts(f"r{i}", tenant=f"t{i % 7}", priority=2))
    clock.advance(31.0)
    core.handle(Tick())                                           # all 300 due: held in P2
    for i in range(299):
        core.handle(StreamClosed(f"r{i}"))
    clock.advance(1.0)
    core.handle(Tick())
    queue = core.waiting.existing_queue("m")
    assert queue is not None and sum(len(h) for h in queue._held.values()) < 100
    core.handle(ClassPaused(2, False))
    assert dict(core.queued_updates())["r299"].priority == 1
