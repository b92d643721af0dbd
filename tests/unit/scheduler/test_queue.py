"""Class queues: priority order, tenant fairness, FIFO, O(1) withdrawal."""

from __future__ import annotations

import itertools

import pytest

from services.scheduler.aging import AgingRule
from services.scheduler.events import StreamClosed
from services.scheduler.queue import ModelQueue
from services.scheduler.queue_policies import FifoOrdering, RoundRobinTenants
from services.scheduler.records import AdmitOptions, QueueEntry

from .helpers import add_engine, admit, make_core, opts, report_load

_seq = itertools.count()


def make_queue() -> ModelQueue:
    return ModelQueue(AgingRule((0.0, 30.0, 30.0)), RoundRobinTenants(), FifoOrdering())


def entry(rid: str, tenant: str, cls: int = 1, arrival: float = 0.0) -> QueueEntry:
    return QueueEntry(
        options=AdmitOptions(request_id=rid, model="m", tenant=tenant, priority=cls,
                             prompt_tokens=1),
        seq=next(_seq), arrival=arrival, base_class=cls, cls=cls, expires_at=1e9,
    )


def drain(queue: ModelQueue) -> list[str]:
    order = []
    while (e := queue.peek()) is not None:
        queue.pop(e)
        order.append(e.request_id)
    return order


@pytest.mark.parametrize(
    ("pushes", "expected"),
    [
        # tenants alternate within a class
        ([("a1", "a"), ("a2", "a"), ("a3", "a"), ("b1", "b"), ("b2", "b")],
         ["a1", "b1", "a2", "b2", "a3"]),
        # three tenants take turns; FIFO within each
        ([("a1", "a"), ("b1", "b"), ("c1", "c"), ("a2", "a"), ("c2", "c")],
         ["a1", "b1", "c1", "a2", "c2"]),
        # one tenant: plain FIFO
        ([("x1", "x"), ("x2", "x"), ("x3", "x")], ["x1", "x2", "x3"]),
    ],
)
def test_fairness_table(pushes: list[tuple[str, str]], expected: list[str]) -> None:
    queue = make_queue()
    for i, (rid, tenant) in enumerate(pushes):
        queue.push(entry(rid, tenant, arrival=float(i)), now=0.0)
    assert drain(queue) == expected


def test_flooding_tenant_delays_another_by_at_most_one_turn() -> None:
    queue = make_queue()
    for i in range(500):
        queue.push(entry(f"flood-{i}", "flooder", arrival=float(i)), now=0.0)
    # serve a few so the flooder is mid-rotation, then a victim arrives
    for _ in range(7):
        queue.pop(queue.peek())
    queue.push(entry("victim", "victim", arrival=1000.0), now=0.0)
    order = drain(queue)
    assert order.index("victim") <= 1
    # and a second victim request waits at most one flooder turn after the first
    queue.push(entry("v1", "victim", arrival=0.0), now=0.0)
    queue.push(entry("v2", "victim", arrival=1.0), now=0.0)
    for i in range(50):
        queue.push(entry(f"f-{i}", "flooder", arrival=float(i)), now=0.0)
    order = drain(queue)
    assert order.index("v2") - order.index("v1") <= 2


def test_fifo_within_tenant_by_arrival_even_when_readmitted_out_of_order() -> None:
    queue = make_queue()
    queue.push(entry("late", "a", arrival=5.0), now=5.0)
    queue.push(entry("early", "a", arrival=1.0), now=5.0)   # re-admitted with its old arrival
    queue.push(entry("mid", "a", arrival=3.0), now=5.0)
    assert drain(queue) == ["early", "mid", "late"]


def test_withdrawn_request_leaves_and_turns_stay_fair() -> None:
    queue = make_queue()
    for rid, tenant in [("a1", "a"), ("b1", "b"), ("a2", "a"), ("b2", "b")]:
        queue.push(entry(rid, tenant), now=0.0)
    assert queue.remove("b1") is not None
    assert queue.remove("b1") is None           # idempotent
    assert "b1" not in queue
    assert drain(queue) == ["a1", "b2", "a2"]


def test_withdrawing_every_request_of_a_tenant_drops_it_from_the_rotation() -> None:
    queue = make_queue()
    queue.push(entry("a1", "a"), now=0.0)
    queue.push(entry("b1", "b"), now=0.0)
    queue.remove("a1")
    assert queue.classes[1].tenant_counts() == {"b": 1}
    assert drain(queue) == ["b1"]


def test_mass_withdrawal_compacts_heaps() -> None:
    """Removal is lazy; stale heap items do not pile up without bound."""
    queue = make_queue()
    for i in range(5000):
        queue.push(entry(f"r{i}", "a"), now=0.0)
    for i in range(4990):
        queue.remove(f"r{i}")
    queue.advance(0.0)
    heap = queue.classes[1]._tenants["a"]  # checking the memory bound
    assert heap.live == 10
    assert len(heap.items) < 200
    assert drain(queue) == [f"r{i}" for i in range(4990, 5000)]


def test_positions_follow_round_robin_rounds() -> None:
    queue = make_queue()
    queue.push(entry("p0", "z", cls=0), now=0.0)
    for i, (rid, tenant) in enumerate([("a1", "a"), ("a2", "a"), ("a3", "a"), ("b1", "b")]):
        queue.push(entry(rid, tenant, arrival=float(i)), now=0.0)
    positions = {e.request_id: p for e, p in queue.positions()}
    assert positions == {"p0": 0, "a1": 1, "b1": 2, "a2": 3, "a3": 4}
    assert [rid for rid, _ in sorted(positions.items(), key=lambda kv: kv[1])] == drain(queue)


def test_p0_admitted_behind_50_p2_is_placed_first() -> None:
    core, _ = make_core(engine_queue_slack=0)
    token = add_engine(core, "e1", max_running=1, report=False)
    for i in range(50):
        admit(core, opts(f"batch-{i}", tenant="batch", priority=2))
    queued = admit(core, opts("chat", tenant="chat", priority=0))
    assert queued.position == 0
    report_load(core, "e1", token)
    assert core.request_state("chat").value == "placed"
    assert all(core.request_state(f"batch-{i}").value == "queued" for i in range(50))


def test_withdraw_from_core_leaves_the_queue_at_once() -> None:
    core, _ = make_core()
    add_engine(core, "e1", report=False)
    admit(core, opts("a"))
    admit(core, opts("b"))
    core.handle(StreamClosed("a"))
    assert core.request_state("a") is None
    assert dict(core.queued_updates())["b"].position == 0
    assert core.queued_total() == 1
    core.handle(StreamClosed("a"))                      # idempotent
    assert core.metrics.value(
        "kvmesh_scheduler_requests_finished_total", {"outcome": "withdrawn"}) == 1
