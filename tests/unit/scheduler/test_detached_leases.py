"""A lease whose gateway vanished (its Admit stream broke while PLACED) is
kept DETACHED for `resume.grace_seconds` on a fake clock: still leased to
its engine (capacity counted, never a preemption victim), re-attached by a
resume of the same tenant and model, released when the grace runs out."""

from __future__ import annotations

from services.scheduler.events import RequestDone, StreamClosed, Tick
from services.scheduler.records import PlacedInfo, RejectedInfo, RejectReason, RequestState

from .helpers import add_engine, admit, make_core, opts

GRACE = 15.0


def _placed_core(**kw: object):
    core, clock = make_core(**kw)
    core._detached._grace = GRACE  # the MeshConfig default, stated here
    add_engine(core, "e1", max_running=1)
    notice = admit(core, opts("r1"))
    assert core.request_state("r1") is RequestState.PLACED, notice
    return core, clock


def test_a_broken_stream_keeps_the_lease_detached_until_the_grace_ends() -> None:
    core, clock = _placed_core()
    lease = core.lease_of("r1")
    core.handle(StreamClosed("r1"))
    assert core.request_state("r1") is RequestState.DETACHED
    assert core.lease_of("r1") is lease  # still leased there: fencing and capacity see it
    assert core.state().leases_total == 1
    clock.advance(GRACE - 0.1)
    core.handle(Tick())
    assert core.request_state("r1") is RequestState.DETACHED
    clock.advance(0.2)
    core.handle(Tick())
    assert core.request_state("r1") is None and core.state().leases_total == 0


def test_a_resume_of_the_same_tenant_reattaches_on_its_engine() -> None:
    core, clock = _placed_core()
    lease = core.lease_of("r1")
    core.handle(StreamClosed("r1"))
    clock.advance(5.0)
    notice = admit(core, opts("r1", resume=True))
    assert isinstance(notice, PlacedInfo)
    assert (notice.engine_id, notice.engine_address, notice.lease_id) == ("e1", "e1:1", lease.lease_id)
    assert core.request_state("r1") is RequestState.PLACED
    clock.advance(GRACE * 2)  # the grace no longer applies
    core.handle(Tick())
    assert core.request_state("r1") is RequestState.PLACED
    core.handle(RequestDone("r1"))
    assert core.request_state("r1") is None


def test_a_resume_from_another_tenant_or_for_an_unknown_id_is_refused() -> None:
    core, clock = _placed_core()
    core.handle(StreamClosed("r1"))
    other = admit(core, opts("r1", tenant="intruder", resume=True))
    assert isinstance(other, RejectedInfo) and other.reason is RejectReason.RESUME_FORBIDDEN
    assert core.request_state("r1") is RequestState.DETACHED  # untouched
    unknown = admit(core, opts("nope", resume=True))
    assert isinstance(unknown, RejectedInfo) and unknown.reason is RejectReason.RESUME_UNKNOWN
    clock.advance(GRACE + 1)
    core.handle(Tick())
    late = admit(core, opts("r1", resume=True))
    assert isinstance(late, RejectedInfo) and late.reason is RejectReason.RESUME_UNKNOWN


def test_a_queued_request_whose_stream_breaks_is_not_kept() -> None:
    core, _ = _placed_core()
    admit(core, opts("r2", model="not-served-yet"))  # waits for its engine's grace
    assert core.request_state("r2") is RequestState.QUEUED
    core.handle(StreamClosed("r2"))
    assert core.request_state("r2") is None


def test_a_detached_lease_is_never_preempted() -> None:
    core, _ = _placed_core(preempt_classes=[0])
    core.handle(StreamClosed("r1"))
    for i in range(4):  # P0 requests that would preempt a P1 lease
        admit(core, opts(f"p0-{i}", priority=0))
    assert core.request_state("r1") is RequestState.DETACHED
    assert core.lease_of("r1") is not None


def test_no_grace_means_no_detaching() -> None:
    core, _ = _placed_core()
    core._detached._grace = 0.0
    core.handle(StreamClosed("r1"))
    assert core.request_state("r1") is None
