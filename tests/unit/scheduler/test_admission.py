"""Admission: caps, TTL, retry-after, malformed requests, unservable ones."""

from __future__ import annotations

import pytest

from services.scheduler.admission_limits import AdmissionLimits, DispatchRateMeter
from services.scheduler.events import ShutdownStarted, Tick
from services.scheduler.records import QueuedInfo, RejectedInfo, RejectReason

from .helpers import add_engine, admit, make_config, make_core, opts, report_load


def test_retry_after_follows_littles_law_and_is_clamped() -> None:
    limits = AdmissionLimits.from_config(make_config().scheduler)
    assert limits.retry_after(100, 10.0) == pytest.approx(10.0)   # 100 ahead at 10/s
    assert limits.retry_after(1, 100.0) == limits.retry_min         # never below the floor
    assert limits.retry_after(10**6, 1.0) == limits.retry_max       # never above the cap
    assert limits.retry_after(5, 0.0) == limits.retry_max           # nothing moving


def test_dispatch_rate_meter_window() -> None:
    meter = DispatchRateMeter(window=10.0)
    for i in range(20):
        meter.record(100.0 + i * 0.5)          # 2/s for 10 s
    assert meter.rate(109.5) == pytest.approx(2.0, rel=0.1)
    assert meter.rate(200.0) == 0.0            # all outside the window


def _full_setup(**kw: object):
    core, clock = make_core(**kw)
    add_engine(core, "e1", report=False)   # known but not placeable: everything queues
    return core, clock


@pytest.mark.parametrize(
    ("caps", "tenant_cap", "admits", "expected"),
    [
        ([10, 2, 10], 100, [("a", 1), ("b", 1), ("c", 1)], RejectReason.QUEUE_FULL),
        # At the tenant cap with nothing of a lower class queued: refused.
        ([10, 10, 10], 2, [("t", 1), ("t", 0), ("t", 1)], RejectReason.TENANT_FULL),
        ([10, 10, 10], 2, [("t", 0), ("t", 0), ("t", 0)], RejectReason.TENANT_FULL),
        ([10, 10, 0], 100, [("t", 2)], RejectReason.QUEUE_FULL),
    ],
)
def test_caps_reject_with_the_right_code(
    caps: list[int], tenant_cap: int, admits: list[tuple[str, int]], expected: RejectReason
) -> None:
    core, _ = _full_setup(queue_caps=caps, tenant_queue_cap=tenant_cap)
    results = [admit(core, opts(f"r{i}", tenant=t, priority=p)) for i, (t, p) in enumerate(admits)]
    assert all(isinstance(r, QueuedInfo) for r in results[:-1])
    last = results[-1]
    assert isinstance(last, RejectedInfo)
    assert last.reason is expected
    limits = AdmissionLimits.from_config(core._config)
    assert limits.retry_min <= last.retry_after_seconds <= limits.retry_max
    assert core.metrics.value(
        "kvmesh_scheduler_rejections_total", {"reason": expected.value}) == 1


def test_retry_after_uses_recent_dispatch_rate() -> None:
    core, clock = make_core(queue_caps=[10, 20, 10])
    token = add_engine(core, "e1", max_running=1000, report=False)
    for i in range(10):                              # 10 placements over 10 s: 1/s
        admit(core, opts(f"w{i}"))
        report_load(core, "e1", token)
        clock.advance(1.0)
    core.fleet.get("e1").last_report_at = None     # stop placing; fill the queue
    for i in range(20):
        assert isinstance(admit(core, opts(f"q{i}")), QueuedInfo)
    rejected = admit(core, opts("over"))
    assert isinstance(rejected, RejectedInfo) and rejected.reason is RejectReason.QUEUE_FULL
    # 20 ahead at ~1/s -> ~20 s
    assert 10.0 <= rejected.retry_after_seconds <= 30.0


def test_ttl_expires_a_waiting_request() -> None:
    core, clock = _full_setup(queue_ttl_seconds=[5.0, 10.0, 20.0])
    admit(core, opts("p0", priority=0))
    admit(core, opts("p2", priority=2))
    clock.advance(5.5)
    out = dict(core.handle(Tick()).notices)
    assert isinstance(out["p0"], RejectedInfo) and out["p0"].reason is RejectReason.EXPIRED
    assert out["p0"].retry_after_seconds > 0
    assert "p2" not in out               # aged or not, P2 keeps its own TTL
    clock.advance(15.0)
    out = dict(core.handle(Tick()).notices)
    assert out["p2"].reason is RejectReason.EXPIRED
    assert core.queued_total() == 0


def test_readmission_already_past_ttl_is_rejected_expired() -> None:
    core, clock = _full_setup(queue_ttl_seconds=[5.0, 10.0, 20.0])
    result = admit(core, opts("old", priority=0, arrival_unix=clock.wall() - 6.0))
    assert isinstance(result, RejectedInfo) and result.reason is RejectReason.EXPIRED


@pytest.mark.parametrize(
    ("kw", "fragment"),
    [
        ({"priority": 3}, "priority 3"),
        ({"priority": -1}, "priority -1"),
        ({"prompt_tokens": 0}, "prompt_tokens"),
        ({"model": ""}, "model is empty"),
    ],
)
def test_invalid_admission(kw: dict, fragment: str) -> None:
    core, _ = make_core()
    result = admit(core, opts("r", **kw))
    assert isinstance(result, RejectedInfo) and result.reason is RejectReason.INVALID
    assert fragment in result.message


def test_duplicate_request_id_is_rejected() -> None:
    core, _ = _full_setup()
    admit(core, opts("r"))
    result = admit(core, opts("r"))
    assert isinstance(result, RejectedInfo) and result.reason is RejectReason.INVALID


def test_unknown_model_queues_during_grace_then_is_rejected() -> None:
    core, clock = make_core(engine_grace_seconds=10.0)
    assert isinstance(admit(core, opts("early", model="nope")), QueuedInfo)
    clock.advance(11.0)
    out = dict(core.handle(Tick()).notices)
    assert out["early"].reason is RejectReason.NO_ENGINE
    later = admit(core, opts("later", model="nope"))
    assert isinstance(later, RejectedInfo) and later.reason is RejectReason.NO_ENGINE


def test_too_large_for_every_engine() -> None:
    core, _ = make_core()
    add_engine(core, "e1", total_blocks=4)        # 64 tokens
    result = admit(core, opts("big", prompt_tokens=1000))
    assert isinstance(result, RejectedInfo) and result.reason is RejectReason.TOO_LARGE


def test_shutdown_rejects_waiting_with_draining() -> None:
    core, _ = _full_setup()
    admit(core, opts("r"))
    out = dict(core.handle(ShutdownStarted()).notices)
    assert out["r"].reason is RejectReason.DRAINING
    assert admit(core, opts("s")).reason is RejectReason.DRAINING
