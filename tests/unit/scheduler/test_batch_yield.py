"""Batch lines yield to interactive work (batch_yield.py): for a request of a
preempt class, the lease slots and KV blocks batch lines hold count as room,
so a P0 stays on the engine holding its context and one batch line there is
preempted (requeued, not failed) instead of the P0 going cold. Ordinary P2
and P1 keep today's rule. All on the fake clock."""

from __future__ import annotations

from typing import Any

from services.scheduler.events import KvSnapshotReported, RequestArrived, RequeueRequested
from services.scheduler.records import PlacedInfo, PreemptedInfo, RequestState

from .helpers import add_engine, admit, make_core, opts
from .test_batch_lines import batch

CONTEXT = (11, 12)          # the shared context's prefix hashes: 32 tokens, all of the prompt


def fleet(fill: str, *, a_running: int = 3, a_fill: int = 2, a_blocks: int = 1000,
          **line_kw: Any) -> tuple[Any, Any]:
    """Engine A holds CONTEXT, `a_fill` leases of `fill` ("batch" or "p2")
    and a P0 in its P0-reserved slot; engine B is cold with free slots."""
    core, clock = make_core(engine_queue_slack=0, p0_reserved_leases=1)
    token = add_engine(core, "A", max_running=a_running, total_blocks=a_blocks)
    core.handle(KvSnapshotReported("A", token, 0, list(CONTEXT)))
    for i in range(a_fill):
        clock.advance(1.0)
        admit(core, batch(f"b{i}", **line_kw) if fill == "batch" else opts(f"b{i}", priority=2, **line_kw))
        assert core.lease_of(f"b{i}").engine_id == "A"
    admit(core, opts("p0-first", priority=0, prefix_hashes=CONTEXT))
    assert core.lease_of("p0-first").engine_id == "A"
    add_engine(core, "B", max_running=3)
    return core, clock


def kinds(out: Any) -> list[tuple[str, str]]:
    return [(rid, type(n).__name__) for rid, n in out.notices]


def batch_preemptions(core: Any) -> int:
    (p2,) = [c for c in core.state().classes if c.priority == 2]
    return p2.batch_preemptions


def test_a_second_p0_takes_a_batch_lines_slot_on_its_warm_engine_and_the_line_is_requeued() -> None:
    core, _ = fleet("batch")
    out = core.handle(RequestArrived(opts("p0-second", priority=0, prefix_hashes=CONTEXT)))
    # the newest line (least progress lost) yields, in the same dispatch
    assert kinds(out) == [("p0-second", "QueuedInfo"), ("b1", "PreemptedInfo"), ("p0-second", "PlacedInfo")]
    placed = dict(out.notices)["p0-second"]
    assert isinstance(placed, PlacedInfo) and placed.engine_id == "A" and placed.cached_tokens == 32
    preempted = dict(out.notices)["b1"]
    assert isinstance(preempted, PreemptedInfo) and preempted.engine_id == "A"
    assert core.request_state("b1") is RequestState.PREEMPTED       # lossless: waits for Requeue
    assert core.request_state("b0") is RequestState.PLACED
    assert batch_preemptions(core) == 1
    assert core.metrics.value("kvmesh_scheduler_batch_preemptions_total") == 1
    core.handle(RequeueRequested("b1", 40, 8, ()))                  # it resumes where there is room
    assert core.request_state("b1") is RequestState.PLACED
    assert core.lease_of("b1").engine_id == "B"


def test_with_ordinary_p2_on_the_warm_engine_the_p0_still_goes_cold_and_preempts_nothing() -> None:
    core, _ = fleet("p2")
    out = core.handle(RequestArrived(opts("p0-second", priority=0, prefix_hashes=CONTEXT)))
    assert kinds(out) == [("p0-second", "QueuedInfo"), ("p0-second", "PlacedInfo")]
    assert core.lease_of("p0-second").engine_id == "B"
    assert {core.request_state(f"b{i}") for i in range(2)} == {RequestState.PLACED}


def test_a_p1_outside_the_preempt_classes_does_not_take_a_batch_lines_slot() -> None:
    core, _ = fleet("batch")
    out = core.handle(RequestArrived(opts("p1", priority=1, prefix_hashes=CONTEXT)))
    assert kinds(out) == [("p1", "QueuedInfo"), ("p1", "PlacedInfo")]
    assert core.lease_of("p1").engine_id == "B"
    assert batch_preemptions(core) == 0


def test_no_batch_line_yields_while_the_warm_engine_has_a_free_slot() -> None:
    core, _ = fleet("batch", a_running=4)                          # one ordinary slot still free on A
    out = core.handle(RequestArrived(opts("p0-second", priority=0, prefix_hashes=CONTEXT)))
    assert kinds(out) == [("p0-second", "QueuedInfo"), ("p0-second", "PlacedInfo")]
    assert core.lease_of("p0-second").engine_id == "A"
    assert batch_preemptions(core) == 0


def test_batch_lines_kv_blocks_count_as_room_too() -> None:
    """A has lease slots left but no free blocks: the batch lines' blocks
    are freeable for a P0, so it still stays warm and one line yields."""
    core, _ = fleet("batch", a_running=8, a_blocks=37, max_tokens=800)   # 2 x 18 + the first P0's 1 (warm)
    assert core.fleet.views("m", 0.0)[0].free_blocks == 0
    out = core.handle(RequestArrived(opts("p0-second", priority=0, prefix_hashes=CONTEXT)))
    assert kinds(out) == [("p0-second", "QueuedInfo"), ("b1", "PreemptedInfo"), ("p0-second", "PlacedInfo")]
    assert core.lease_of("p0-second").engine_id == "A"


def test_an_empty_preempt_classes_turns_the_rule_off() -> None:
    core, _ = make_core(engine_queue_slack=0, p0_reserved_leases=1, preempt_classes=[])
    token = add_engine(core, "A", max_running=2)
    core.handle(KvSnapshotReported("A", token, 0, list(CONTEXT)))
    admit(core, batch("b0"))
    admit(core, opts("p0-first", priority=0, prefix_hashes=CONTEXT))
    add_engine(core, "B", max_running=2)
    admit(core, opts("p0-second", priority=0, prefix_hashes=CONTEXT))
    assert core.lease_of("p0-second").engine_id == "B"
    assert core.request_state("b0") is RequestState.PLACED


def test_no_batch_line_yields_when_another_engine_is_as_warm_and_has_a_free_slot() -> None:
    """Even where the policy would rather use A once its batch lines were
    gone: a line yields only to spare the request a colder placement."""
    core, _ = fleet("batch")
    token_b = core.fleet.get("B").token
    core.handle(KvSnapshotReported("B", token_b, 0, list(CONTEXT)))
    for i in range(2):                    # B busier than A would be without its batch lines
        admit(core, opts(f"o{i}", priority=2))
        assert core.lease_of(f"o{i}").engine_id == "B"
    out = core.handle(RequestArrived(opts("p0-second", priority=0, prefix_hashes=CONTEXT)))
    assert kinds(out) == [("p0-second", "QueuedInfo"), ("p0-second", "PlacedInfo")]
    assert core.lease_of("p0-second").engine_id == "B"
    assert batch_preemptions(core) == 0


def test_with_approximate_prefixes_the_memory_learns_only_the_placement_taken() -> None:
    """A profile without KV events remembers where it sent each prefix; the
    trial placement over the yielded views must not teach it an engine the
    request did not go to."""
    core, _ = make_core(engine_queue_slack=0, p0_reserved_leases=1, policy="prefix_approx")
    add_engine(core, "A", max_running=2)
    admit(core, batch("b0"))
    admit(core, opts("p0-first", priority=0, prefix_hashes=CONTEXT))   # A learns CONTEXT
    add_engine(core, "B", max_running=2)
    admit(core, opts("p0-second", priority=0, prefix_hashes=CONTEXT))
    assert core.lease_of("p0-second").engine_id == "A"                  # b0 yielded
    assert core.request_state("b0") is RequestState.PREEMPTED
    memory = core.policy.approx
    assert memory is not None and memory.prefix_matches(CONTEXT, ["A", "B"]) == {"A": 2, "B": 0}
