"""Batch API lines in the scheduler (AdmitRequest.batch): P2 without aging,
never a P0-reserved lease slot, after ordinary P2, first preemption victim
(never protected), a TTL from the batch's deadline, a queue cap of their own,
and visible in GetState and the metrics. All on the fake clock."""

from __future__ import annotations

import math
from typing import Any

import pytest

from services.common.config import PolicyProfileConfig
from services.common.proto.kvmesh.v1 import scheduler_pb2
from services.scheduler.events import KvSnapshotReported, RequestArrived, RequestDone, RequeueRequested, Tick
from services.scheduler.grpc_api import _options, _state_proto
from services.scheduler.placement import EngineView
from services.scheduler.preemption import Candidate, choose_victim
from services.scheduler.records import (
    PlacedInfo,
    PreemptedInfo,
    QueuedInfo,
    RejectedInfo,
    RejectReason,
    RequestState,
)

from .helpers import MODEL, add_engine, admit, make_core, opts, report_load

# One engine slot per running request; a third of the default aging (P2 ->
# P0 after 60 s): the tests move the clock past it.
TIGHT: dict[str, Any] = dict(engine_queue_slack=0, p0_reserved_leases=0)
PAST_AGING = 61.0


def batch(request_id: str, tenant: str = "t", **kw: Any) -> Any:
    return opts(request_id, tenant=tenant, priority=2, batch=True, **kw)


def queued_class(core: Any, request_id: str) -> int:
    entry = core.waiting.queue(MODEL).get(request_id)
    assert entry is not None, request_id
    return entry.cls


def tick(core: Any, clock: Any, seconds: float, engine: tuple[str, int] | None = None) -> list[tuple[str, Any]]:
    """Move the clock; with `engine` (id, token) that engine reports first, so
    it is fresh (placeable) when the tick dispatches."""
    clock.advance(seconds)
    notices = report_load(core, *engine) if engine else []
    return [*notices, *core.handle(Tick()).notices]


# ---------------------------------------------------------------- aging

def test_a_batch_line_is_never_aged_while_ordinary_p2_still_is() -> None:
    core, clock = make_core(preempt_classes=[], **TIGHT)
    add_engine(core, "e1", max_running=1)
    admit(core, opts("busy", priority=0))                 # holds the only slot
    assert core.lease_of("busy") is not None
    admit(core, batch("b"))
    admit(core, opts("o", priority=2))
    tick(core, clock, PAST_AGING)
    assert queued_class(core, "o") == 0                    # ordinary P2 aged to P0
    assert queued_class(core, "b") == 2                    # the batch line did not
    tick(core, clock, 1000.0)
    assert queued_class(core, "b") == 2
    assert core.metrics.value("kvmesh_scheduler_promotions_total", {"from_priority": "P2",
                                                                   "to_priority": "P1"}) == 1


def test_a_requeued_batch_line_is_not_aged_either() -> None:
    core, clock = make_core(**TIGHT)
    add_engine(core, "e1", max_running=1)
    admit(core, batch("b"))
    out = core.handle(RequestArrived(opts("chat", priority=0)))
    assert isinstance(dict(out.notices)["b"], PreemptedInfo)
    tick(core, clock, PAST_AGING)
    core.handle(RequeueRequested("b", 40, 8, ()))
    assert queued_class(core, "b") == 2


# ---------------------------------------------------------------- P0-reserved slot

def test_a_batch_line_never_takes_the_p0_reserved_slot_where_an_aged_p2_would() -> None:
    core, clock = make_core(engine_queue_slack=0, p0_reserved_leases=1, preempt_classes=[])
    e1 = ("e1", add_engine(core, "e1", max_running=2))     # 2 slots, 1 kept for P0
    admit(core, batch("b1"))
    assert core.lease_of("b1") is not None
    admit(core, batch("b2"))
    tick(core, clock, 3 * PAST_AGING, e1)
    assert core.request_state("b2") is RequestState.QUEUED
    admit(core, opts("o", priority=2))                     # ordinary P2: no slot now ...
    assert core.request_state("o") is RequestState.QUEUED
    tick(core, clock, PAST_AGING, e1)                      # ... until it ages to P0
    assert core.request_state("o") is RequestState.PLACED
    assert core.request_state("b2") is RequestState.QUEUED


def test_a_profile_without_the_lease_slot_filter_still_keeps_batch_out_of_it() -> None:
    bare = PolicyProfileConfig(filters=["model", "serving", "fresh", "has_room"])
    core, _ = make_core(engine_queue_slack=0, p0_reserved_leases=1, policy="bare",
                            policy_profiles={"bare": bare})
    add_engine(core, "e1", max_running=2)
    admit(core, batch("b1"))
    admit(core, batch("b2"))
    assert core.lease_of("b1") is not None
    assert core.request_state("b2") is RequestState.QUEUED


def test_a_batch_copy_does_not_take_the_together_shortcut_past_the_slot_filters() -> None:
    core, _ = make_core(engine_queue_slack=0, p0_reserved_leases=1)
    add_engine(core, "e1", max_running=2)
    admit(core, batch("b"))
    copy = admit(core, batch("b#1", together_with="b"))
    assert isinstance(copy, QueuedInfo)
    assert core.request_state("b#1") is RequestState.QUEUED
    # an ordinary copy still takes it (the shortcut itself is unchanged)
    admit(core, opts("c", priority=0))
    assert isinstance(admit(core, opts("c#1", priority=0, together_with="c")), PlacedInfo)


# ---------------------------------------------------------------- order among P2

def test_ordinary_p2_leaves_the_queue_before_earlier_batch_lines() -> None:
    core, clock = make_core(preempt_classes=[], **TIGHT)
    add_engine(core, "e1", max_running=1)
    admit(core, opts("busy", priority=0))
    admit(core, batch("b", tenant="x"))
    clock.advance(1.0)
    admit(core, opts("o", tenant="y", priority=2))
    queue = core.waiting.queue(MODEL)
    assert [e.request_id for e, _ in queue.positions()] == ["o", "b"]
    assert queue.position_of(queue.get("b")) == 1
    out = core.handle(RequestArrived(opts("done-probe", priority=2)))  # queued behind, nothing moves
    assert [rid for rid, n in out.notices if isinstance(n, PlacedInfo)] == []
    placed = core.handle(RequestDone("busy")).notices
    assert [rid for rid, n in placed if isinstance(n, PlacedInfo)] == ["o"]


# ---------------------------------------------------------------- preemption

def _cand(engine: str, rid: str, *, cls: int = 2, placed_at: float = 0.0, preemptions: int = 0,
          batch: bool = False) -> Candidate:
    return Candidate(engine, rid, cls, placed_at, preemptions, 1, batch)


def _view(engine_id: str, prefix_blocks: int = 0) -> EngineView:
    return EngineView(
        engine_id=engine_id, model="m", serving=True, draining=False, fresh=True, block_size=16,
        blocks_total=100, blocks_used=0, blocks_reserved=0, leases=2, lease_limit=2, max_running=2,
        running=2, waiting=0, queued_tokens=0, weight=1.0, max_model_len=0, queue_seconds=0.0,
        prefix_blocks=prefix_blocks, blocks_needed=1)


@pytest.mark.parametrize(
    ("candidates", "expected"),
    [
        # same engine: the batch line before a newer ordinary P2 (or any P1)
        ([_cand("e2", "o", placed_at=5.0), _cand("e2", "b", placed_at=1.0, batch=True)], "b"),
        ([_cand("e2", "p1", cls=1, placed_at=5.0), _cand("e2", "b", batch=True)], "b"),
        # fleet-wide: a batch line on a worse engine before ordinary P2 on the best one
        ([_cand("best", "o"), _cand("e2", "b", batch=True)], "b"),
        # among batch lines, the usual rule: best engine, then newest
        ([_cand("e2", "b1", batch=True, placed_at=9.0), _cand("best", "b2", batch=True),
          _cand("best", "b3", batch=True, placed_at=3.0)], "b3"),
        # never protected: a batch line preempted max_preemptions times still yields
        ([_cand("e2", "o", preemptions=5), _cand("e2", "b", preemptions=5, batch=True)], "b"),
        # no batch line: as before
        ([_cand("best", "o1", placed_at=1.0), _cand("best", "o2", placed_at=2.0)], "o2"),
        ([_cand("best", "o", preemptions=2)], None),
    ],
)
def test_victim_rule_puts_batch_lines_first(candidates: list[Candidate], expected: str | None) -> None:
    engines = [_view("best", prefix_blocks=4), _view("e2")]
    choice = choose_victim(0, engines, candidates, max_preemptions=2)
    assert (choice.victim.request_id if choice else None) == expected


def test_a_p0_preempts_the_batch_line_not_the_newer_ordinary_p2_and_counts_it() -> None:
    core, clock = make_core(**TIGHT)
    add_engine(core, "e1", max_running=2)
    admit(core, batch("b"))
    clock.advance(1.0)
    admit(core, opts("o", priority=2))
    out = core.handle(RequestArrived(opts("chat", priority=0)))
    assert [(rid, type(n).__name__) for rid, n in out.notices] == [
        ("chat", "QueuedInfo"), ("b", "PreemptedInfo"), ("chat", "PlacedInfo")]
    (p2,) = [c for c in core.state().classes if c.priority == 2]
    assert (p2.preemptions, p2.batch_preemptions, p2.protected) == (1, 1, 0)
    assert core.metrics.value("kvmesh_scheduler_batch_preemptions_total") == 1


def test_a_batch_line_is_preempted_past_the_bound_and_never_counted_protected() -> None:
    core, _ = make_core(max_preemptions=1, **TIGHT)
    add_engine(core, "e1", max_running=1)
    admit(core, batch("b"))
    for i in range(3):
        out = core.handle(RequestArrived(opts(f"chat{i}", priority=0)))
        assert isinstance(dict(out.notices)["b"], PreemptedInfo), i
        core.handle(RequeueRequested("b", 40, 8, ()))
        core.handle(RequestDone(f"chat{i}"))
        assert core.lease_of("b") is not None
    (p2,) = [c for c in core.state().classes if c.priority == 2]
    assert (p2.batch_preemptions, p2.protected) == (3, 0)


# ---------------------------------------------------------------- TTL

def test_a_batch_line_waits_until_its_deadline_not_the_p2_ttl() -> None:
    core, clock = make_core(preempt_classes=[], queue_ttl_seconds=[60.0, 300.0, 600.0], **TIGHT)
    add_engine(core, "e1", max_running=1)
    admit(core, opts("busy", priority=0))
    admit(core, batch("b", batch_deadline_unix=clock.wall() + 5000.0))
    admit(core, batch("b0"))                                   # 0 = the P2 TTL
    admit(core, opts("o", priority=2))
    expired = {rid for rid, n in tick(core, clock, 601.0) if isinstance(n, RejectedInfo)}
    assert expired == {"o", "b0"}
    assert core.request_state("b") is RequestState.QUEUED
    assert tick(core, clock, 4000.0) == []
    (rejected,) = tick(core, clock, 400.0)
    assert rejected[0] == "b" and rejected[1].reason is RejectReason.EXPIRED


def test_a_batch_line_past_its_deadline_is_refused_at_admission() -> None:
    core, clock = make_core()
    add_engine(core, "e1")
    notice = admit(core, batch("late", batch_deadline_unix=clock.wall() - 1.0))
    assert isinstance(notice, RejectedInfo) and notice.reason is RejectReason.EXPIRED


@pytest.mark.parametrize("bad", [dict(priority=1), dict(batch_deadline_unix=math.nan),
                                 dict(batch_deadline_unix=-1.0), dict(batch_deadline_unix=math.inf)])
def test_malformed_batch_admissions_are_invalid(bad: dict[str, Any]) -> None:
    core, _ = make_core()
    add_engine(core, "e1")
    options = opts("x", **{"priority": 2, "batch": True, **bad})
    notice = admit(core, options)
    assert isinstance(notice, RejectedInfo) and notice.reason is RejectReason.INVALID


# ---------------------------------------------------------------- caps

def test_batch_lines_count_against_their_own_cap_only() -> None:
    core, _ = make_core(preempt_classes=[], batch_queue_cap=2, tenant_queue_cap=2,
                        queue_caps=[10, 10, 2], **TIGHT)
    add_engine(core, "e1", max_running=1)
    admit(core, opts("busy", priority=0))
    assert isinstance(admit(core, batch("b1")), QueuedInfo)
    assert isinstance(admit(core, batch("b2")), QueuedInfo)
    full = admit(core, batch("b3"))
    assert isinstance(full, RejectedInfo) and full.reason is RejectReason.QUEUE_FULL
    assert "batch queue" in full.message
    # the tenant's and the P2 queue's room are untouched by its two batch lines
    assert isinstance(admit(core, opts("o1", priority=2)), QueuedInfo)
    assert isinstance(admit(core, opts("o2", priority=2)), QueuedInfo)
    # at the tenant cap a P0 displaces its ordinary P2, never a batch line
    out = core.handle(RequestArrived(opts("c", priority=0))).notices
    assert [rid for rid, n in out if isinstance(n, RejectedInfo)] == ["o2"]
    assert core.request_state("b1") is core.request_state("b2") is RequestState.QUEUED


# ---------------------------------------------------------------- visible

def test_get_state_and_metrics_show_batch_lines_apart() -> None:
    core, clock = make_core(preempt_classes=[], **TIGHT)
    add_engine(core, "e1", max_running=1)
    admit(core, opts("busy", priority=0))
    admit(core, batch("b1", tenant="x"))
    admit(core, batch("b2", tenant="x"))
    admit(core, opts("o", tenant="x", priority=2))
    tick(core, clock, 1.0)
    state = _state_proto(core.state())
    rows = {(q.priority, q.tenant, q.batch): q.queued for q in state.queues}
    assert rows == {(2, "x", False): 1, (2, "x", True): 2}
    (p2,) = [c for c in state.classes if c.priority == 2]
    assert p2.batch_queued == 2
    assert core.metrics.value("kvmesh_scheduler_batch_queued") == 2
    assert core.metrics.value("kvmesh_scheduler_queue_length", {"priority": "P2"}) == 1


def test_the_grpc_boundary_runs_a_batch_line_as_p2_whatever_priority_it_carries() -> None:
    msg = scheduler_pb2.AdmitRequest(request_id="r", model="m", priority=0, prompt_tokens=1,
                                     batch=True, batch_deadline_unix=1.8e9)
    options = _options(msg)
    assert (options.priority, options.batch, options.batch_deadline_unix) == (2, True, 1.8e9)
    assert _options(scheduler_pb2.AdmitRequest(request_id="r", model="m", priority=0)).priority == 0


# ---------------------------------------------------------------- P0 placement beside a batch

@pytest.mark.parametrize(("batch_work", "p0_goes_to"), [(True, "warm"), (False, "cold")])
def test_a_p0_stays_on_its_warm_engine_however_many_batch_lines_run_there(batch_work: bool, p0_goes_to: str) -> None:
    """A P0 runs in the engine's P0 headroom, ahead of batch lines, so their
    leases do not count as queueing for it: it keeps its cached context. The
    same load of ordinary P2 work still counts (the sticky policy's margin,
    unchanged)."""
    core, _ = make_core(engine_queue_slack=2, p0_reserved_leases=1)
    token = add_engine(core, "warm", max_running=2)
    core.handle(KvSnapshotReported("warm", token, 0, [11, 12]))
    for i in range(3):
        admit(core, batch(f"w{i}") if batch_work else opts(f"w{i}", priority=2))
        assert core.lease_of(f"w{i}").engine_id == "warm"
    add_engine(core, "cold", max_running=2)
    admit(core, opts("chat", priority=0, prefix_hashes=(11, 12)))
    assert core.lease_of("chat").engine_id == p0_goes_to
