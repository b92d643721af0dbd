"""Engine identity across restarts (engine_registry.py): incarnations decide
which process of an engine id is registered. On the registry itself, then
on the core with a fake clock (leases of a superseded process end as if the
engine was lost), then over real gRPC (the old stream is ended and an older
hello refused FAILED_PRECONDITION with `kvmesh-superseded-by`)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from services.common.proto.kvmesh.v1 import scheduler_pb2 as pb
from services.engine.scheduler_link import new_incarnation, superseded_by
from services.scheduler.engine_links import SUPERSEDED_METADATA_KEY
from services.scheduler.engine_registry import (
    DuplicateEngineError,
    EngineInfo,
    EngineRegistry,
    SupersededEngineError,
)
from services.scheduler.events import EngineJoined, EngineLeft, ReplaceRequested, RequestArrived, Tick
from services.scheduler.records import PlacedInfo, RejectedInfo

from .helpers import MODEL, admit, make_core, opts, report_load
from .test_grpc import TIMEOUT, stack, wait_state  # noqa: F401 - the fixture

OLD, NEW = 1_000 << 22, 2_000 << 22


def info(address: str, incarnation: int, engine_id: str = "e") -> EngineInfo:
    return EngineInfo(engine_id=engine_id, address=address, model=MODEL, block_size=16, total_blocks=1000,
                      max_running=8, weight=1.0, max_model_len=0, incarnation=incarnation)


# ---------------------------------------------------------------- the registry's rules


def test_a_newer_incarnation_supersedes_whatever_its_address() -> None:
    registry = EngineRegistry(2.0)
    first = registry.register(info("10.0.0.1:50100", OLD), 0.0).record
    first.leases.add("lease-1")
    registration = registry.register(info("10.0.0.2:50100", NEW), 1.0)
    assert registration.superseded is first and registration.replaced is None
    assert registry.get("e") is registration.record
    assert registration.record.info.address == "10.0.0.2:50100"
    assert not registration.record.leases            # the old process's leases do not carry over
    # The same DNS name, a new process behind it: superseded all the same.
    name = "e.kvmesh-engine.kvmesh.svc.cluster.local:50100"
    registry.register(info(name, NEW), 2.0)
    newest = registry.register(info(name, NEW + 1), 3.0)
    assert newest.superseded is not None and newest.superseded.info.address == name


def test_an_older_incarnation_is_refused_even_after_the_newer_one_left() -> None:
    registry = EngineRegistry(2.0)
    registry.register(info("a:1", OLD), 0.0)
    new = registry.register(info("b:1", NEW), 1.0).record
    with pytest.raises(SupersededEngineError) as refused:
        registry.register(info("a:1", OLD), 2.0)
    assert refused.value.newer_address == "b:1"
    assert "superseded by a newer process" in str(refused.value)
    assert registry.get("e") is new                  # nothing changed
    # The newer process's stream drops: the old one still cannot come back...
    assert registry.unregister("e", new.token) is new
    with pytest.raises(SupersededEngineError):
        registry.register(info("a:1", OLD), 3.0)
    assert registry.get("e") is None
    # ...while the newer one reconnects, from anywhere.
    assert registry.register(info("c:1", NEW), 4.0).record.info.address == "c:1"


def test_the_same_incarnation_reconnecting_replaces_and_keeps_its_leases() -> None:
    registry = EngineRegistry(2.0)
    first = registry.register(info("a:1", OLD), 0.0).record
    first.leases.add("lease-1")
    # Its old stream has not ended here yet (a dropped connection).
    again = registry.register(info("a:1", OLD), 1.0)
    assert again.replaced is first and again.superseded is None
    assert again.record.leases == {"lease-1"}
    assert again.record.token != first.token
    assert registry.unregister("e", first.token) is None   # the old stream's late close is ignored
    assert registry.get("e") is again.record
    # After the stream did end, the same process is welcome back.
    assert registry.unregister("e", again.record.token) is again.record
    assert registry.register(info("a:1", OLD), 2.0).replaced is None


def test_hellos_without_an_incarnation_keep_the_address_rule() -> None:
    registry = EngineRegistry(2.0)
    registry.register(info("a:1", 0), 0.0)
    with pytest.raises(DuplicateEngineError):
        registry.register(info("b:1", 0), 1.0)
    with pytest.raises(DuplicateEngineError):     # an id held by an engine of no incarnation
        registry.register(info("b:1", NEW), 1.0)
    assert registry.register(info("a:1", NEW), 2.0).replaced is not None  # same address: a restart


def test_incarnations_of_later_starts_compare_greater() -> None:
    first = new_incarnation()
    assert 0 < first < 2**63
    # 2 ms later: the millisecond part decides, whatever the random bits.
    later = ((first >> 22) + 2) << 22
    assert later > first
    assert len({new_incarnation() for _ in range(50)}) == 50


# ---------------------------------------------------------------- on the core (fake clock)


def _join(core, address: str, incarnation: int, engine_id: str = "e"):
    return core.handle(EngineJoined(info(address, incarnation, engine_id)))


def test_superseding_ends_the_old_processs_leases_as_if_it_was_lost() -> None:
    core, clock = make_core()
    token = _join(core, "old:1", OLD).token
    report_load(core, "e", token)
    outbox = core.handle(RequestArrived(opts("r1")))
    placed = [n for rid, n in outbox.notices if rid == "r1" and isinstance(n, PlacedInfo)]
    assert placed and placed[0].engine_address == "old:1" and placed[0].engine_incarnation == OLD
    clock.advance(0.5)                       # well within any keepalive: nothing timed out
    joined = _join(core, "new:1", NEW)
    assert joined.superseded is not None
    assert (joined.superseded.address, joined.superseded.incarnation, joined.superseded.leases) == (
        "old:1", OLD, 1)
    assert joined.superseded.was_fresh      # it reported 0.5 s ago: the log calls it out
    # r1 waits ORPHANED for its gateway (the engine-lost path), no lease left.
    assert core.request_state("r1").value == "orphaned"
    assert core.lease_of("r1") is None and core.fleet.lease_count() == 0
    # The old stream's late close changes nothing; the new process is placed on.
    core.handle(EngineLeft("e", token))
    report_load(core, "e", joined.token)
    admit(core, opts("r2"))
    lease = core.lease_of("r2")
    assert lease is not None and lease.engine_id == "e"
    assert [e.address for e in core.state().engines] == ["new:1"]
    assert core.state().engines[0].incarnation == NEW


def test_a_refused_older_hello_changes_nothing() -> None:
    core, _ = make_core()
    token = _join(core, "new:1", NEW).token
    report_load(core, "e", token)
    admit(core, opts("r1"))
    with pytest.raises(SupersededEngineError):
        _join(core, "old:1", OLD)
    assert core.lease_of("r1") is not None and core.lease_of("r1").engine_id == "e"
    assert [e.address for e in core.state().engines] == ["new:1"]


def _replace(core, request_id: str):
    return core.handle(ReplaceRequested(request_id, ("e",), 48, 8, ())).notices


def test_a_replace_may_go_to_the_new_process_of_the_engine_it_excludes() -> None:
    """The gateway excludes the engine id its stream failed on; once a newer
    process holds that id, the exclusion is moot (the failed process is
    gone): with one engine for the model, the request moves to the new
    process instead of being refused no_engine."""
    core, _ = make_core()
    report_load(core, "e", _join(core, "old:1", OLD).token)
    admit(core, opts("r1"))
    joined = _join(core, "new:1", NEW)
    report_load(core, "e", joined.token)
    notices = _replace(core, "r1")
    placed = [n for rid, n in notices if rid == "r1"]
    assert len(placed) == 1 and isinstance(placed[0], PlacedInfo), placed
    assert (placed[0].engine_address, placed[0].engine_incarnation) == ("new:1", NEW)


def test_an_exclusion_of_the_same_process_still_holds() -> None:
    """The excluded process still reports serving: the replacement is not
    placed on it; it waits (issue 29) and is refused once
    engine_return_seconds passed since the Replace."""
    core, clock = make_core(engine_return_seconds=30.0)
    token = _join(core, "a:1", OLD).token
    report_load(core, "e", token)
    admit(core, opts("r1"))
    assert [n for rid, n in _replace(core, "r1") if rid == "r1"] == []
    clock.advance(20.0)
    assert [n for rid, n in report_load(core, "e", token) if rid == "r1"] == []   # still serving: not placed
    assert core.lease_of("r1") is None
    clock.advance(10.0)
    refused = [n for rid, n in core.handle(Tick()).notices if rid == "r1"]
    assert len(refused) == 1 and isinstance(refused[0], RejectedInfo)
    assert refused[0].reason.value == "no_engine"


def test_a_replace_excluding_a_stalled_engine_that_reports_serving_goes_to_its_restart() -> None:
    """Issue 29's chaos case: both engines of the model are excluded (one died,
    one stalled but still reporting serving). The replacement waits in the
    lane and is placed as soon as a restarted process of an excluded id
    registers: the exclusion covers only the process it ran on."""
    core, clock = make_core()
    old = _join(core, "old:1", OLD)
    report_load(core, "e", old.token)
    other = _join(core, "f:1", OLD, engine_id="f")
    report_load(core, "f", other.token)
    admit(core, opts("r1"))
    ran_on = core.lease_of("r1").engine_id
    core.handle(ReplaceRequested("r1", ("e", "f"), 48, 8, ()))
    assert core.request_state("r1").value == "replacing"
    clock.advance(40.0)
    assert _answers(core.handle(Tick()).notices, "r1") == []
    assert _answers(report_load(core, "f", other.token), "r1") == []     # f still says serving
    restarted = _join(core, "new:1", NEW, engine_id=ran_on)
    placed = (_answers(restarted.notices, "r1")
              + _answers(report_load(core, ran_on, restarted.token), "r1"))
    assert len(placed) == 1 and isinstance(placed[0], PlacedInfo), placed
    assert (placed[0].engine_id, placed[0].engine_address, placed[0].engine_incarnation) == (ran_on, "new:1", NEW)


def _answers(notices, request_id: str) -> list:
    return [n for rid, n in notices if rid == request_id]


def test_a_replace_waits_for_its_models_only_engine_to_come_back() -> None:
    """The model's only engine died mid-stream (a killed vLLM core: the engine
    exits and is restarted). Refusing the stream's Replace at once would lose
    the text it already streamed: it waits, and goes to the restarted
    process, which the exclusion of the dead one no longer covers."""
    core, clock = make_core()
    old = _join(core, "old:1", OLD)
    report_load(core, "e", old.token)
    admit(core, opts("r1"))
    clock.advance(300.0)  # served for a while: the model's "last seen" is its engine's leaving
    core.handle(EngineLeft("e", old.token))
    assert _answers(_replace(core, "r1"), "r1") == []       # waiting, not refused
    clock.advance(45.0)                                      # the engine restarts meanwhile
    assert _answers(core.handle(Tick()).notices, "r1") == []
    new = _join(core, "new:1", NEW)
    placed = _answers(new.notices, "r1") + _answers(report_load(core, "e", new.token), "r1")
    assert len(placed) == 1 and isinstance(placed[0], PlacedInfo), placed
    assert (placed[0].engine_address, placed[0].engine_incarnation) == ("new:1", NEW)


def test_a_replace_excluding_a_failing_engine_still_connected_waits_for_its_restart() -> None:
    """The replace can arrive while the failed engine is still connected,
    exiting (it reported not serving): the exclusion covers that process
    only, so the request waits for the new one instead of being refused."""
    core, clock = make_core()
    old = _join(core, "old:1", OLD)
    report_load(core, "e", old.token)
    admit(core, opts("r1"))
    report_load(core, "e", old.token, serving=False)       # its backend died: failing
    assert _answers(_replace(core, "r1"), "r1") == []       # waiting, not refused
    core.handle(EngineLeft("e", old.token))
    clock.advance(40.0)
    new = _join(core, "new:1", NEW)
    placed = _answers(new.notices, "r1") + _answers(report_load(core, "e", new.token), "r1")
    assert len(placed) == 1 and isinstance(placed[0], PlacedInfo), placed


def test_a_replace_is_refused_once_its_model_stayed_unserved_past_the_return_bound() -> None:
    core, clock = make_core(engine_return_seconds=30.0)
    old = _join(core, "old:1", OLD)
    report_load(core, "e", old.token)
    admit(core, opts("r1"))
    core.handle(EngineLeft("e", old.token))
    assert _answers(_replace(core, "r1"), "r1") == []
    clock.advance(31.0)
    refused = _answers(core.handle(Tick()).notices, "r1")
    assert len(refused) == 1 and isinstance(refused[0], RejectedInfo), refused
    assert refused[0].reason.value == "no_engine"


# ---------------------------------------------------------------- over gRPC


def _hello(address: str, incarnation: int) -> pb.EngineMessage:
    return pb.EngineMessage(hello=pb.EngineHello(
        engine_id="eng-1", address=address, model="m", block_size=16, total_blocks=1000,
        max_running=4, weight=1.0, hash_block_tokens=16, backend="fake", incarnation=incarnation))


async def _refusal(call) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as ended:
        while True:
            await asyncio.wait_for(call.read(), TIMEOUT)
    return ended.value


async def test_a_newer_process_ends_the_old_stream_and_an_older_hello_is_refused(stack) -> None:  # noqa: F811
    _, stub, _ = stack
    old = stub.Connect(timeout=TIMEOUT * 3)
    await old.write(_hello("127.0.0.1:1", OLD))
    await old.write(pb.EngineMessage(load=pb.LoadReport(serving=True, blocks_total=1000)))
    await wait_state(stub, lambda s: len(s.engines) == 1 and s.engines[0].fresh)

    # The old stream stays open (a stopped process): the new one is in at once.
    new = stub.Connect(timeout=TIMEOUT * 3)
    name = "eng-1.kvmesh-engine.kvmesh.svc.cluster.local:50100"
    await new.write(_hello(name, NEW))
    await new.write(pb.EngineMessage(load=pb.LoadReport(serving=True, blocks_total=1000)))
    state = await wait_state(stub, lambda s: len(s.engines) == 1 and s.engines[0].address == name)
    assert state.engines[0].incarnation == NEW

    ended = await _refusal(old)
    assert ended.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert superseded_by(ended) == name
    assert "a newer process of this engine registered" in ended.details()

    # The old process comes back (say, after a partition): refused, same answer.
    again = stub.Connect(timeout=TIMEOUT * 3)
    await again.write(_hello("127.0.0.1:1", OLD))
    refused = await _refusal(again)
    assert refused.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert dict(refused.trailing_metadata())[SUPERSEDED_METADATA_KEY] == name
    # The new process is still the one registered, and its reports count.
    await new.write(pb.EngineMessage(load=pb.LoadReport(serving=True, blocks_total=1000, running=2)))
    await wait_state(stub, lambda s: len(s.engines) == 1 and s.engines[0].running == 2)
    new.cancel()


def _stall_then_kill(core, clock):  # the core and clock of make_core
    """RELIABILITY.md "a stall, then the next engine's death": r1 ran on e,
    e stalled (its stream moved off on the gateway's stall deadline) and f,
    the model's other engine, was killed: the Replace excludes both."""
    e = _join(core, "e:1", OLD)
    report_load(core, "e", e.token, backend_progress=10)
    f = _join(core, "f:1", OLD, engine_id="f")
    report_load(core, "f", f.token, backend_progress=10)
    admit(core, opts("r1"))
    core.handle(EngineLeft("f", f.token))
    clock.advance(1.0)
    core.handle(ReplaceRequested("r1", ("e", "f"), 48, 8, ()))
    assert core.request_state("r1").value == "replacing"
    return e


def test_a_replacement_goes_back_to_an_excluded_engine_that_recovered() -> None:
    """e was slow, not hung: its backend works again (its progress count moves
    between two reports after the Replace), so the request goes back to it
    rather than waiting for f's restart and being refused past the bound."""
    core, clock = make_core()
    e = _stall_then_kill(core, clock)
    clock.advance(0.5)
    assert _answers(report_load(core, "e", e.token, backend_progress=12), "r1") == []   # first report after
    clock.advance(0.5)
    placed = _answers(report_load(core, "e", e.token, backend_progress=13), "r1")
    assert len(placed) == 1 and isinstance(placed[0], PlacedInfo), placed
    assert placed[0].engine_id == "e"


def test_a_hung_engines_late_count_does_not_lift_its_exclusion() -> None:
    """A core that hung still had outputs before it stopped: the first report
    after the Replace may show them (moved from a report received before the
    Replace). Then the count stands still: the exclusion holds (issue 29's
    rule: a stopped core's engine reports serving), and the request waits."""
    core, clock = make_core()
    e = _stall_then_kill(core, clock)
    for _ in range(10):
        clock.advance(0.5)
        assert _answers(report_load(core, "e", e.token, backend_progress=12), "r1") == []
    assert core.request_state("r1").value == "replacing"


def test_an_engine_without_the_count_keeps_the_old_rule() -> None:
    """An engine from before `backend_progress` sends 0: never lifted by it."""
    core, clock = make_core()
    e = _stall_then_kill(core, clock)
    for _ in range(4):
        clock.advance(0.5)
        assert _answers(report_load(core, "e", e.token, backend_progress=0), "r1") == []
