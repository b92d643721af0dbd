"""An engine's heartbeat -- a report repeating its last load -- changes no
room, so the core does not dispatch after it: with a queue waiting (a busy
fleet, a batch backlog) every dispatch tries to place the queue's head, and
at 1,024 engines the heartbeats alone (~2,000/s) made those failed attempts
most of a core. Anything that may make room still dispatches: a changed
load, an engine fresh again after going stale, KV events with the report,
and progress while a replacement waits for an engine."""

from __future__ import annotations

import pytest

from services.scheduler.core import SchedulerCore
from services.scheduler.events import KvEventsReported, LoadReported

from .helpers import add_engine, admit, make_core, opts, report_load

pytestmark = pytest.mark.unit


def _attempts(core: SchedulerCore) -> float:
    """Placement decisions made so far (each a pass of the policy)."""
    return core.metrics.value("kvmesh_scheduler_decision_seconds_count", {"policy": core.policy.name})


def _full_engine_and_a_queue(core: SchedulerCore) -> int:
    token = add_engine(core, "e1", max_running=1)
    admit(core, opts("running"))
    admit(core, opts("waiting"))
    assert core.request_state("running").value == "placed"
    assert core.request_state("waiting").value == "queued"
    report_load(core, "e1", token, running=1, request_ids=["running"])
    return token


def test_a_heartbeat_makes_no_placement_attempt() -> None:
    core, clock = make_core(engine_queue_slack=0)
    token = _full_engine_and_a_queue(core)
    before = _attempts(core)
    for _ in range(20):
        clock.advance(0.5)
        assert report_load(core, "e1", token, running=1, request_ids=["running"]) == []
    assert _attempts(core) == before


def test_a_changed_load_still_dispatches() -> None:
    core, clock = make_core(engine_queue_slack=0)
    token = _full_engine_and_a_queue(core)
    before = _attempts(core)
    clock.advance(0.5)
    report_load(core, "e1", token, running=1, request_ids=["running"], blocks_used=3)
    assert _attempts(core) == before + 1


def test_a_heartbeat_after_the_engine_went_stale_dispatches() -> None:
    core, clock = make_core(engine_queue_slack=0, stale_report_seconds=2.0)
    token = _full_engine_and_a_queue(core)
    before = _attempts(core)
    clock.advance(3.0)   # silent past the bound: not placeable
    report_load(core, "e1", token, running=1, request_ids=["running"])
    assert _attempts(core) > before


def test_kv_events_in_a_report_dispatch_once_with_it() -> None:
    core, clock = make_core(engine_queue_slack=0)
    token = _full_engine_and_a_queue(core)
    before = _attempts(core)
    clock.advance(0.5)
    load = core.fleet.get("e1").load
    assert core.handle(KvEventsReported("e1", token, 1, [11, 12], [], False, in_report=True)).notices == []
    assert _attempts(core) == before
    core.handle(LoadReported("e1", token, load, with_kv=True))
    assert _attempts(core) == before + 1
