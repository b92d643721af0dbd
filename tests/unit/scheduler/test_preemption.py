"""Preemption: a P0 (or a configured P1) never waits for lower-class running
work; the victim rule; Requeue with the original arrival; finished exactly
once; the preemption bound; tenant-cap displacement of the lowest class."""

from __future__ import annotations

from typing import Any

import pytest

from services.scheduler.events import (
    EngineLeft,
    KvSnapshotReported,
    Outbox,
    ReplaceRequested,
    RequestArrived,
    RequestDone,
    RequeueRequested,
    StreamClosed,
    Tick,
)
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

from .helpers import add_engine, admit, make_core, opts, report_load

# One lease slot per running request, none kept for P0: every slot can be
# taken by batch work, so only preemption lets a P0 in.
TIGHT: dict[str, Any] = dict(engine_queue_slack=0, p0_reserved_leases=0)


def arrive(core: Any, options: Any) -> Outbox:
    return core.handle(RequestArrived(options))


def kinds(outbox: Outbox) -> list[tuple[str, str]]:
    return [(rid, type(notice).__name__) for rid, notice in outbox.notices]


def fill(core: Any, clock: Any, ids: list[str], priority: int = 2) -> None:
    """Admit and place each request, 0.1 s apart (distinct placed_at)."""
    for rid in ids:
        admit(core, opts(rid, tenant="batch", priority=priority))
        assert core.lease_of(rid) is not None, rid
        clock.advance(0.1)


# ---------------------------------------------------------------- in the core

def test_p0_preempts_one_p2_on_the_engine_holding_its_prefix_and_is_placed_there_at_once() -> None:
    core, clock = make_core(**TIGHT)
    tokens = {e: add_engine(core, e, max_running=2) for e in ("e1", "e2")}
    core.handle(KvSnapshotReported("e2", tokens["e2"], 0, [11, 12]))
    fill(core, clock, [f"b{i}" for i in range(4)])
    on_e2 = sorted((core.lease_of(f"b{i}").placed_at, f"b{i}") for i in range(4)
                   if core.lease_of(f"b{i}").engine_id == "e2")
    newest_on_e2 = on_e2[-1][1]

    out = arrive(core, opts("chat", tenant="web", priority=0, prefix_hashes=(11, 12)))

    assert kinds(out) == [("chat", "QueuedInfo"), (newest_on_e2, "PreemptedInfo"), ("chat", "PlacedInfo")]
    preempted = out.notices[1][1]
    assert preempted == PreemptedInfo(engine_id="e2", preemptions=1, by_priority=0)
    placed = out.notices[2][1]
    assert isinstance(placed, PlacedInfo) and placed.engine_id == "e2" and placed.cached_tokens == 32
    assert core.request_state(newest_on_e2) is RequestState.PREEMPTED
    assert core.lease_of(newest_on_e2) is None
    assert sum(1 for i in range(4) if core.request_state(f"b{i}") is RequestState.PLACED) == 3
    (p2,) = [c for c in core.state().classes if c.priority == 2]
    assert (p2.preemptions, p2.preempted_now) == (1, 1)
    assert core.metrics.value("kvmesh_scheduler_preemptions_total", {"priority": "P2"}) == 1
    assert core.metrics.value("kvmesh_scheduler_preempted_requests", {"priority": "P2"}) == 1


def test_a_victim_s_reported_blocks_count_as_free_until_the_next_report() -> None:
    """The victim's blocks are in the engine's last report; the newcomer must
    fit on them at once, not after the engine reports again."""
    core, _ = make_core(**TIGHT)
    token = add_engine(core, "e1", max_running=1, total_blocks=10, block_size=16)
    admit(core, opts("big", tenant="batch", priority=2, prompt_tokens=100, max_tokens=16))
    blocks = core.lease_of("big").reserved_blocks
    report_load(core, "e1", token, running=1, blocks_used=blocks, request_ids=["big"])
    assert core.state().engines[0].view.blocks_reserved == 0   # settled into blocks_used
    out = arrive(core, opts("chat", priority=0, prompt_tokens=100, max_tokens=16))
    assert kinds(out)[1:] == [("big", "PreemptedInfo"), ("chat", "PlacedInfo")]


@pytest.mark.parametrize(
    ("preempt_classes", "newcomer", "expect_preempted"),
    [
        ([0], 0, True),
        ([0], 1, False),       # default: P1 waits
        ([0, 1], 1, True),     # P1 may preempt P2
        ([], 0, False),        # disabled: P0 waits as before
    ],
)
def test_preempt_classes(preempt_classes: list[int], newcomer: int, expect_preempted: bool) -> None:
    core, clock = make_core(preempt_classes=preempt_classes, **TIGHT)
    add_engine(core, "e1", max_running=2)
    fill(core, clock, ["b0", "b1"])
    out = arrive(core, opts("new", tenant="web", priority=newcomer))
    preempted = [rid for rid, n in out.notices if isinstance(n, PreemptedInfo)]
    assert preempted == (["b1"] if expect_preempted else [])
    assert (core.lease_of("new") is not None) is expect_preempted


def test_p0_never_preempts_p0_and_p1_never_preempts_p1() -> None:
    core, clock = make_core(preempt_classes=[0, 1], **TIGHT)
    add_engine(core, "e1", max_running=2)
    fill(core, clock, ["c0", "c1"], priority=0)
    out = arrive(core, opts("c2", priority=0))
    assert kinds(out) == [("c2", "QueuedInfo")]
    core2, clock2 = make_core(preempt_classes=[0, 1], **TIGHT)
    add_engine(core2, "e1", max_running=1)
    fill(core2, clock2, ["n0"], priority=1)
    assert kinds(arrive(core2, opts("n1", priority=1))) == [("n1", "QueuedInfo")]


def test_an_aged_lease_counts_in_the_class_it_was_placed_in() -> None:
    """A P2 that waited into P0 before its placement is not a P2 victim."""
    core, clock = make_core(**TIGHT)
    token = add_engine(core, "e1", max_running=1, report=False)
    admit(core, opts("old", tenant="batch", priority=2))
    clock.advance(61.0)                         # aged P2 -> P1 -> P0 while waiting
    report_load(core, "e1", token)
    assert core.lease_of("old").cls == 0
    assert kinds(arrive(core, opts("chat", priority=0))) == [("chat", "QueuedInfo")]


# ---------------------------------------------------------------- requeue

def _preempted(**config: Any) -> tuple[Any, Any, int]:
    """e1 (one slot) runs P2 "b" placed at t=0; P0 "chat" preempts it at t=10."""
    core, clock = make_core(**TIGHT, **config)
    token = add_engine(core, "e1", max_running=1)
    admit(core, opts("b", tenant="batch", priority=2))
    clock.advance(10.0)
    report_load(core, "e1", token)
    out = arrive(core, opts("chat", tenant="web", priority=0))
    assert kinds(out)[1:] == [("b", "PreemptedInfo"), ("chat", "PlacedInfo")]
    return core, clock, token


def test_requeue_keeps_the_original_arrival_ages_and_is_not_expired() -> None:
    core, clock, token = _preempted(queue_ttl_seconds=[60.0, 300.0, 20.0])
    out = core.handle(RequeueRequested("b", prompt_tokens=40, max_tokens=8, prefix_hashes=(5,)))
    assert out.notices == []                    # queued silently: the engine is taken
    assert core.request_state("b") is RequestState.QUEUED
    ((rid, info),) = core.queued_updates()
    assert rid == "b" and info.priority == 2
    clock.advance(20.5)                         # t=30.5: 30 s since ARRIVAL, past its P2 TTL of 20 s
    report_load(core, "e1", token)
    core.handle(Tick())
    ((rid, info),) = core.queued_updates()
    assert info.priority == 1                   # aged from the original arrival (t=0), not t=10
    assert core.request_state("b") is RequestState.QUEUED   # no TTL after a preemption
    (p2,) = [c for c in core.state().classes if c.priority == 2]
    assert (p2.requeued, p2.preempted_now, p2.seconds_lost) == (1, 1, 0.0)

    out = core.handle(RequestDone("chat"))
    ((rid, placed),) = out.notices
    assert rid == "b" and isinstance(placed, PlacedInfo)
    lease = core.lease_of("b")
    assert lease.prompt_tokens == 40 and lease.cls == 1
    (p2,) = [c for c in core.state().classes if c.priority == 2]
    assert p2.preempted_now == 0 and p2.seconds_lost == pytest.approx(20.5)
    assert core.metrics.value("kvmesh_scheduler_preempted_seconds_count", {"priority": "P2"}) == 1
    assert core.metrics.value("kvmesh_scheduler_requeued_total", {"priority": "P2"}) == 1


@pytest.mark.parametrize("event", [RequestDone("b"), StreamClosed("b")], ids=["done", "stream_end"])
def test_a_preempted_record_is_finished_exactly_once(event: Any) -> None:
    core, _, _ = _preempted()
    core.handle(event)
    core.handle(RequestDone("b"))
    core.handle(StreamClosed("b"))
    assert core.request_state("b") is None
    finished = sum(core.metrics.value("kvmesh_scheduler_requests_finished_total", {"outcome": o})
                   for o in ("done", "withdrawn", "rejected"))
    assert finished == 1
    (p2,) = [c for c in core.state().classes if c.priority == 2]
    assert p2.preempted_now == 0
    # A Requeue crossing the done is ignored.
    assert core.handle(RequeueRequested("b", 40, 8, ())).notices == []
    assert core.request_state("b") is None


def test_requeue_for_a_request_that_is_not_preempted_is_ignored() -> None:
    core, _, _ = _preempted()
    lease = core.lease_of("chat")
    assert core.handle(RequeueRequested("chat", 40, 8, ())).notices == []
    assert core.request_state("chat") is RequestState.PLACED and core.lease_of("chat") is lease
    core.handle(RequeueRequested("b", 40, 8, ()))
    core.handle(RequeueRequested("b", 50, 8, ()))      # a repeat: already queued
    assert core.request_state("b") is RequestState.QUEUED and core.queued_total() == 1


def test_max_preemptions_protects_a_request() -> None:
    core, _, _ = _preempted(max_preemptions=1)
    core.handle(RequeueRequested("b", 40, 8, ()))
    out = core.handle(RequestDone("chat"))
    assert [rid for rid, n in out.notices if isinstance(n, PlacedInfo)] == ["b"]
    out = arrive(core, opts("chat-2", tenant="web", priority=0))
    assert kinds(out) == [("chat-2", "QueuedInfo")]      # "b" is protected: the P0 waits
    assert core.request_state("b") is RequestState.PLACED
    (p2,) = [c for c in core.state().classes if c.priority == 2]
    assert (p2.preemptions, p2.protected) == (1, 1)


def test_a_replace_crossing_a_preempted_queues_it_like_a_requeue() -> None:
    core, _, _ = _preempted()
    core.handle(ReplaceRequested("b", ("e9",), 40, 8, ()))
    assert core.request_state("b") is RequestState.QUEUED


def test_a_replace_crossing_a_preempted_that_excludes_every_engine_waits_for_one_to_come_back() -> None:
    """Issue 29: the crossing Replace names the model's only engine. It is not
    refused at once (it has streamed text): it waits in the Replace lane,
    holding up no one, and is refused no_engine only once
    engine_return_seconds passed since the Replace."""
    core, clock, token = _preempted(engine_return_seconds=30.0)
    out = core.handle(ReplaceRequested("b", ("e1",), 40, 8, ()))
    assert out.notices == [] and core.request_state("b") is RequestState.REPLACING
    core.handle(RequestDone("chat"))
    clock.advance(20.0)
    out = report_load(core, "e1", token)          # e1 has room again, but it is excluded
    assert [rid for rid, _ in out] == [] and core.lease_of("b") is None
    admit(core, opts("after", tenant="web", priority=1))
    assert core.lease_of("after") is not None     # the waiting replacement holds no one up
    clock.advance(10.5)
    refused = [n for rid, n in core.handle(Tick()).notices if rid == "b"]
    assert len(refused) == 1 and isinstance(refused[0], RejectedInfo), refused
    assert refused[0].reason is RejectReason.NO_ENGINE


# ---------------------------------------------------------------- the victim rule (pure)

def view(engine_id: str, *, prefix: int = 0, leases: int = 2, limit: int = 2, free: int = 100,
         needed: int = 1) -> EngineView:
    return EngineView(
        engine_id=engine_id, model="m", serving=True, draining=False, fresh=True, block_size=16,
        blocks_total=1000, blocks_used=1000 - free, blocks_reserved=0, leases=leases,
        lease_limit=limit, max_running=limit, running=leases, waiting=0, queued_tokens=0,
        weight=1.0, max_model_len=0, queue_seconds=0.0, prefix_blocks=prefix, blocks_needed=needed)


def cand(engine_id: str, rid: str, cls: int = 2, placed_at: float = 0.0, preemptions: int = 0,
         blocks: int = 1) -> Candidate:
    return Candidate(engine_id, rid, cls, placed_at, preemptions, blocks)


VICTIM_CASES = [
    # (name, newcomer class, engines, candidates, expected (engine, victim) or None)
    ("lowest class first", 0, [view("e1")],
     [cand("e1", "p1", cls=1, placed_at=9.0), cand("e1", "p2", cls=2, placed_at=1.0)], ("e1", "p2")),
    ("then most recently placed", 0, [view("e1")],
     [cand("e1", "old", placed_at=1.0), cand("e1", "new", placed_at=5.0)], ("e1", "new")),
    ("then request id", 0, [view("e1")],
     [cand("e1", "b", placed_at=1.0), cand("e1", "a", placed_at=1.0)], ("e1", "a")),
    ("same or higher class is never a victim", 1, [view("e1")],
     [cand("e1", "p0", cls=0), cand("e1", "p1", cls=1)], None),
    ("protected is skipped", 0, [view("e1")],
     [cand("e1", "tired", preemptions=2, placed_at=9.0), cand("e1", "fresh", placed_at=1.0)],
     ("e1", "fresh")),
    ("engine with the longest prefix first", 0, [view("e1", leases=1), view("e2", prefix=3)],
     [cand("e1", "x"), cand("e2", "y")], ("e2", "y")),
    ("then the fewest leases", 0, [view("e1", leases=3, limit=3), view("e2", leases=2)],
     [cand("e1", "x"), cand("e2", "y")], ("e2", "y")),
    ("then engine id", 0, [view("e2"), view("e1")], [cand("e2", "y"), cand("e1", "x")], ("e1", "x")),
    ("an engine where one victim frees too few blocks is skipped", 0,
     [view("e1", prefix=3, free=0, needed=5), view("e2", free=0, needed=5)],
     [cand("e1", "small", blocks=2), cand("e2", "large", blocks=5)], ("e2", "large")),
    ("a bigger victim on the best engine when the newest is too small", 0,
     [view("e1", free=0, needed=4)],
     [cand("e1", "small", blocks=1, placed_at=9.0), cand("e1", "large", blocks=4)], ("e1", "large")),
    ("no candidate", 0, [view("e1")], [], None),
]


@pytest.mark.parametrize(("newcomer", "engines", "candidates", "expected"),
                         [c[1:] for c in VICTIM_CASES], ids=[c[0] for c in VICTIM_CASES])
def test_victim_rule(newcomer: int, engines: list[EngineView], candidates: list[Candidate],
                     expected: tuple[str, str] | None) -> None:
    choice = choose_victim(newcomer, engines, candidates, max_preemptions=2)
    got = None if choice is None else (choice.view.engine_id, choice.victim.request_id)
    assert got == expected


def test_victim_rule_with_a_custom_fit_test() -> None:
    choice = choose_victim(0, [view("e1", prefix=1), view("e2")], [cand("e1", "x"), cand("e2", "y")],
                           2, fits=lambda v: v.engine_id == "e2")
    assert choice is not None and choice.victim.request_id == "y"


# ---------------------------------------------------------------- admission displaces the lowest class

def _full(**config: Any) -> Any:
    core, _ = make_core(**config)
    add_engine(core, "e1", report=False)        # known but not placeable: everything queues
    return core


def test_tenant_cap_displaces_the_newest_of_the_lowest_class() -> None:
    core = _full(tenant_queue_cap=3)
    for rid, p in (("a2", 2), ("b2", 2), ("c1", 1)):
        assert isinstance(admit(core, opts(rid, tenant="t", priority=p)), QueuedInfo)
    out = arrive(core, opts("chat", tenant="t", priority=0))
    assert kinds(out) == [("chat", "QueuedInfo"), ("b2", "RejectedInfo")]
    rejected = out.notices[1][1]
    assert rejected.reason is RejectReason.TENANT_FULL and rejected.retry_after_seconds > 0
    assert "displaced by a higher-class (P0) request of the same tenant" in rejected.message
    assert core.request_state("b2") is None
    # A P1 newcomer still finds a P2 below it; then nothing below P1 is left.
    assert kinds(arrive(core, opts("n1", tenant="t", priority=1)))[1] == ("a2", "RejectedInfo")
    refused = admit(core, opts("n2", tenant="t", priority=1))
    assert isinstance(refused, RejectedInfo) and refused.reason is RejectReason.TENANT_FULL
    # A P0 is refused only when nothing of a lower class of its tenant is queued.
    assert kinds(arrive(core, opts("chat-2", tenant="t", priority=0)))[1] == ("n1", "RejectedInfo")
    assert kinds(arrive(core, opts("chat-3", tenant="t", priority=0)))[1] == ("c1", "RejectedInfo")
    refused = admit(core, opts("chat-4", tenant="t", priority=0))
    assert isinstance(refused, RejectedInfo) and refused.reason is RejectReason.TENANT_FULL
    assert [(c.priority, c.displaced) for c in core.state().classes] == [(0, 0), (1, 2), (2, 2)]
    assert core.metrics.value("kvmesh_scheduler_displaced_total", {"priority": "P2"}) == 2
    # Another tenant is untouched.
    assert isinstance(admit(core, opts("other", tenant="u", priority=2)), QueuedInfo)


def test_class_cap_is_not_relieved_by_lower_classes() -> None:
    core = _full(queue_caps=[1, 10, 10])
    admit(core, opts("p2", priority=2))
    admit(core, opts("p0", priority=0))
    refused = admit(core, opts("p0-b", priority=0))
    assert isinstance(refused, RejectedInfo) and refused.reason is RejectReason.QUEUE_FULL
    assert core.request_state("p2") is RequestState.QUEUED


def test_a_requeued_request_is_never_displaced() -> None:
    core, _, _ = _preempted(tenant_queue_cap=1)
    core.handle(RequeueRequested("b", 40, 8, ()))
    refused = admit(core, opts("chat-2", tenant="batch", priority=0))
    assert isinstance(refused, RejectedInfo) and refused.reason is RejectReason.TENANT_FULL
    assert core.request_state("b") is RequestState.QUEUED


def test_a_p0_replacement_preempts_too_avoiding_the_engines_it_excludes() -> None:
    """A P0 whose engine failed waits in the Replace lane: it does not wait
    for lower-class running work either."""
    core, _ = make_core(**TIGHT)
    tokens = {e: add_engine(core, e, max_running=1) for e in ("e1", "e2")}
    admit(core, opts("chat", tenant="web", priority=0))
    failed = core.lease_of("chat").engine_id
    other = "e2" if failed == "e1" else "e1"
    admit(core, opts("b", tenant="batch", priority=2))
    assert core.lease_of("b").engine_id == other
    core.handle(EngineLeft(failed, tokens[failed]))
    out = core.handle(ReplaceRequested("chat", (failed,), 40, 8, ()))
    assert kinds(out) == [("b", "PreemptedInfo"), ("chat", "PlacedInfo")]
    assert core.lease_of("chat").engine_id == other
