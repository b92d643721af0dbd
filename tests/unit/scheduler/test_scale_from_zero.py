"""Scale from zero (scheduler.scaling.enabled): a model with no engine queues
its requests past engine_grace_seconds, up to cold_start_wait_seconds from
each one's arrival, and its queued demand makes the desired count >= 1."""

from __future__ import annotations

from services.common.clock import FakeClock
from services.common.config import ModelConfig, ScalingConfig
from services.scheduler.core import SchedulerCore
from services.scheduler.events import EngineLeft, Tick
from services.scheduler.records import PlacedInfo, QueuedInfo, RejectedInfo, RejectReason

from .helpers import MODEL, add_engine, admit, make_config, make_core, opts


def _autoscaled(wait: float = 60.0) -> tuple[SchedulerCore, FakeClock]:
    config = make_config(engine_grace_seconds=10.0, scaling=ScalingConfig(
        enabled=True, min_engines=0, max_engines=2, cold_start_wait_seconds=wait))
    config.models.append(ModelConfig(name=MODEL))   # configured: counted before any engine serves it
    clock = FakeClock()
    return SchedulerCore(config, clock), clock


def test_a_request_waits_past_the_grace_for_an_engine_to_start() -> None:
    core, clock = _autoscaled()
    clock.advance(100.0)                                # long after start-up: the grace is over
    assert isinstance(admit(core, opts("first", priority=0)), QueuedInfo)
    core.handle(Tick())                                  # the next housekeeping tick, not the next interval
    [decision] = [d for d in core.state().scaling if d.model == MODEL]
    assert decision.desired == 1 and decision.current == 0 and decision.autoscaled  # decided at once
    clock.advance(40.0)                                  # past P0's 20 s queue floor and the grace
    assert "first" not in dict(core.handle(Tick()).notices)
    add_engine(core, "e1")
    assert core.lease_holder("first") == "e1"


def test_past_the_bound_it_is_the_clear_error() -> None:
    core, clock = _autoscaled(wait=30.0)
    assert isinstance(admit(core, opts("r", priority=0)), QueuedInfo)
    clock.advance(31.0)
    out = dict(core.handle(Tick()).notices)
    assert isinstance(out["r"], RejectedInfo) and out["r"].reason is RejectReason.NO_ENGINE
    assert "cold_start_wait_seconds" in out["r"].message


def test_all_engines_gone_queues_too() -> None:
    core, clock = _autoscaled()
    token = add_engine(core, "e1")
    core.handle(EngineLeft("e1", token))
    clock.advance(50.0)
    assert isinstance(admit(core, opts("after", priority=1)), QueuedInfo)
    clock.advance(20.0)
    core.handle(Tick())
    add_engine(core, "e2")
    assert core.lease_holder("after") == "e2"


def test_without_autoscaling_the_grace_still_refuses() -> None:
    core, clock = make_core(clock=FakeClock(), engine_grace_seconds=10.0)
    clock.advance(11.0)
    got = admit(core, opts("r"))
    assert isinstance(got, RejectedInfo) and got.reason is RejectReason.NO_ENGINE
    assert not isinstance(got, PlacedInfo)
