"""Lease fencing's decision (services/scheduler/fencing.py) on a fake clock:
what an engine runs without a lease here is fenced, never what a race, a
scheduler restart or a vanished Connect stream makes look unleased."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from services.common.clock import FakeClock
from services.common.config import FencingConfig
from services.common.grpc_server import client_options
from services.common.proto.kvmesh.v1 import scheduler_pb2 as pb
from services.common.proto.kvmesh.v1 import scheduler_pb2_grpc
from services.scheduler.events import EngineLeft, FirstToken, ReplaceRequested, RequestDone
from services.scheduler.fencing import FenceBook
from services.scheduler.server import SchedulerService

from .helpers import add_engine, admit, make_config, make_core, opts, report_load
from .test_grpc import admit_msg, hello, wait_state

START = 1000.0
CONFIG = FencingConfig(confirm_seconds=1.0, startup_grace_seconds=10.0, rejoin_grace_seconds=3.0)
AFTER_GRACE = START + 20.0


def _book(joined_at: float = AFTER_GRACE - 5.0, config: FencingConfig = CONFIG) -> FenceBook:
    book = FenceBook(config, START)
    book.joined("e1", joined_at)
    return book


def _reports(book: FenceBook, holders: dict[str, str | None], ids: list[str], times: list[float],
             engine: str = "e1") -> list[list[str]]:
    return [book.check(engine, ids, holders.get, t) for t in times]


def test_an_id_leased_to_the_engine_is_never_fenced() -> None:
    book = _book()
    assert _reports(book, {"a": "e1"}, ["a"], [AFTER_GRACE + i * 0.5 for i in range(10)]) == [[]] * 10


@pytest.mark.parametrize(("holder", "why"), [(None, "request gone"), ("e2", "migrated to e2")])
def test_an_unleased_id_is_fenced_after_two_reports_a_confirm_period_apart(holder: str | None, why: str) -> None:
    book = _book()
    t = AFTER_GRACE
    # "b", leased here, runs beside it.
    got = _reports(book, {"a": holder, "b": "e1"}, ["a", "b"], [t, t + 0.5, t + 1.0, t + 1.5])
    assert got == [[], [], ["a"], []], why
    assert book.fenced_total == 1


def test_one_report_is_never_enough_however_long_ago_it_was_first_seen() -> None:
    book = _book()
    assert book.check("e1", ["a"], {}.get, AFTER_GRACE) == []
    # The id vanished from a report: its count starts again.
    assert book.check("e1", [], {}.get, AFTER_GRACE + 5) == []
    assert book.check("e1", ["a"], {}.get, AFTER_GRACE + 10) == []
    assert book.check("e1", ["a"], {}.get, AFTER_GRACE + 11) == ["a"]


def test_a_still_reported_fenced_id_is_fenced_again_after_another_confirm_period() -> None:
    book = _book()
    t = AFTER_GRACE
    got = _reports(book, {}, ["a"], [t, t + 1, t + 1.5, t + 2.0, t + 2.6])
    assert got == [[], ["a"], [], ["a"], []]   # 1 s after the first fence


def test_a_lease_ending_just_before_a_report_is_not_fenced() -> None:
    """`done` (or a preemption) races the engine's last report of the id."""
    book = _book()
    holders: dict[str, str | None] = {"a": "e1"}
    assert book.check("e1", ["a"], holders.get, AFTER_GRACE) == []
    holders["a"] = None                                   # the lease ended
    assert book.check("e1", ["a"], holders.get, AFTER_GRACE + 0.1) == []
    assert book.check("e1", [], holders.get, AFTER_GRACE + 0.2) == []   # the engine let go
    assert book.check("e1", [], holders.get, AFTER_GRACE + 5) == []


def test_nothing_is_fenced_during_the_startup_grace() -> None:
    """After a scheduler restart, gateways re-attach running requests' leases."""
    book = _book(joined_at=START + 0.5)
    holders: dict[str, str | None] = {}
    times = [START + 1 + i for i in range(9)]             # up to START + 9
    assert _reports(book, holders, ["a", "b"], times) == [[]] * 9
    holders["a"] = "e1"                                   # re-attached in time
    assert book.check("e1", ["a", "b"], holders.get, START + 10.1) == ["b"]


def test_nothing_is_fenced_on_an_engine_during_its_rejoin_grace() -> None:
    book = _book()
    t = AFTER_GRACE
    book.check("e1", ["a"], {}.get, t)
    book.joined("e1", t + 0.5)                            # re-registered: suspects start again
    assert _reports(book, {}, ["a"], [t + 1, t + 2, t + 3]) == [[], [], []]
    assert book.check("e1", ["a"], {}.get, t + 3.6) == ["a"]


def test_disabled_or_unregistered_engines_fence_nothing() -> None:
    off = _book(config=FencingConfig(enabled=False))
    assert _reports(off, {}, ["a"], [AFTER_GRACE, AFTER_GRACE + 5]) == [[], []]
    book = _book()
    assert _reports(book, {}, ["a"], [AFTER_GRACE, AFTER_GRACE + 5], engine="e9") == [[], []]
    book.left("e1")
    assert _reports(book, {}, ["a"], [AFTER_GRACE, AFTER_GRACE + 5]) == [[], []]


# ---------------------------------------------------------------- the core's lease table


def test_the_core_answers_who_holds_each_request() -> None:
    core, _ = make_core(FakeClock(START))
    add_engine(core, "e1", max_running=4)
    add_engine(core, "e2", max_running=4)
    admit(core, opts("r1"))
    holder = core.lease_holder("r1")
    assert holder in ("e1", "e2")
    assert core.lease_holder("nobody") is None
    core.handle(FirstToken("r1"))
    core.handle(RequestDone("r1"))
    assert core.lease_holder("r1") is None                # finished: fenced wherever it still runs


def test_an_orphaned_request_still_counts_as_held_by_the_engine_it_lost() -> None:
    """The engine's Connect stream broke, its gateway still streams from it:
    that is no orphan of the engine's. Once the gateway moves it, it is."""
    core, clock = make_core(FakeClock(START))
    t1 = add_engine(core, "e1", max_running=4)
    admit(core, opts("r1"))
    assert core.lease_holder("r1") == "e1"
    core.handle(EngineLeft("e1", t1))
    assert core.lease_holder("r1") == "e1"
    t1 = add_engine(core, "e1", max_running=4)            # the partition healed
    add_engine(core, "e2", max_running=4)
    assert core.lease_holder("r1") == "e1"
    # The gateway saw e1 fail and replaced the request: now e2 holds it.
    core.handle(ReplaceRequested("r1", ("e1",), 40, 8, ()))
    assert core.lease_holder("r1") == "e2"
    report_load(core, "e1", t1, request_ids=["r1"])
    book = FenceBook(CONFIG, START)
    book.joined("e1", START)
    clock.advance(20)
    now = clock.monotonic()
    assert book.check("e1", ["r1"], core.lease_holder, now) == []
    assert book.check("e1", ["r1"], core.lease_holder, now + 1) == ["r1"]
    assert book.check("e2", ["r1"], core.lease_holder, now + 1) == []


# ---------------------------------------------------------------- over gRPC


async def test_the_scheduler_fences_over_the_connect_stream() -> None:
    """A real scheduler on a fake clock: the engine reports a leased request
    and an orphan; past the grace, two reports a second apart bring a Fence
    naming the orphan only (and nothing before the grace ends)."""
    clock = FakeClock(START)
    service = SchedulerService(make_config(tick_seconds=0.05), clock=clock)
    port = await service.start(port=0)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=client_options())
    stub = scheduler_pb2_grpc.SchedulerStub(channel)
    try:
        engine = stub.Connect(timeout=60)
        await engine.write(hello("eng-1"))

        sent = 0

        async def report() -> None:
            """One report, handled before the clock moves on (its `waiting`
            is a sequence number GetState shows)."""
            nonlocal sent
            sent += 1
            await engine.write(pb.EngineMessage(load=pb.LoadReport(
                serving=True, blocks_total=1000, waiting=sent, request_ids=["r1", "orphan"])))
            await wait_state(stub, lambda s: len(s.engines) == 1 and s.engines[0].waiting == sent)

        await report()
        admit = stub.Admit(timeout=60)
        await admit.write(admit_msg("r1"))
        while (await asyncio.wait_for(admit.read(), 10)).WhichOneof("msg") != "placed":
            pass
        for _ in range(3):                       # within the startup grace: nothing
            clock.advance(2)
            await report()
        clock.advance(20)
        await report()
        clock.advance(1)
        await report()
        command = await asyncio.wait_for(engine.read(), 10)
        assert command.WhichOneof("cmd") == "fence"
        assert list(command.fence.request_ids) == ["orphan"]
        assert service.servicer.fences.fenced_total == 1
        assert service.metrics.registry.get_sample_value(
            "kvmesh_scheduler_fenced_total", {"engine": "eng-1"}) == 1.0
        admit.cancel()
        engine.cancel()
    finally:
        await channel.close()
        await service.stop(grace=0.5)
