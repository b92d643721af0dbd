"""The scheduler's issue-17 gauges and counters: decision latency, engines
serving and flapping, the engines' reported prefix hit rate, the GIE pool
gauges, the oldest queued request against the aging bound, restarts."""

from __future__ import annotations

import time

import pytest

from services.common.clock import FakeClock
from services.common.config import ModelConfig
from services.scheduler.core import SchedulerCore
from services.scheduler.events import DrainRequested, EngineLeft, Tick
from services.scheduler.fleet_gauges import FleetGauges

from .helpers import MODEL, add_engine, admit, make_config, make_core, opts, report_load


def test_decision_latency_by_policy() -> None:
    core, _ = make_core()
    add_engine(core, "e1")
    admit(core, opts("r1"))
    admit(core, opts("r2"))
    assert core.metrics.value("kvmesh_scheduler_decision_seconds_count", {"policy": core.policy.name}) == 2
    assert core.metrics.value("kvmesh_scheduler_decision_seconds_sum", {"policy": core.policy.name}) > 0


def test_engine_serving_and_flaps() -> None:
    core, clock = make_core()
    serving = "kvmesh_scheduler_engine_serving"
    flaps = "kvmesh_scheduler_engine_flaps_total"
    token = add_engine(core, "e1")
    core.handle(Tick())
    assert core.metrics.value(serving, {"engine": "e1", "model_name": MODEL}) == 1
    assert core.metrics.value(flaps, {"engine": "e1"}) == 0  # appearing is not a flap
    report_load(core, "e1", token, serving=False)
    core.handle(Tick())
    assert core.metrics.value(serving, {"engine": "e1", "model_name": MODEL}) == 0
    report_load(core, "e1", token)
    core.handle(Tick())
    assert core.metrics.value(flaps, {"engine": "e1"}) == 2
    core.handle(DrainRequested("e1"))
    core.handle(Tick())
    assert core.metrics.value(serving, {"engine": "e1", "model_name": MODEL}) == 0
    assert core.metrics.value(flaps, {"engine": "e1"}) == 3
    # A stale report is not serving either.
    token2 = add_engine(core, "e2")
    core.handle(Tick())
    assert core.metrics.value(serving, {"engine": "e2", "model_name": MODEL}) == 1
    clock.advance(core.fleet._config.stale_report_seconds + 1)
    core.handle(Tick())
    assert core.metrics.value(serving, {"engine": "e2", "model_name": MODEL}) == 0
    report_load(core, "e2", token2)
    core.handle(Tick())
    assert core.metrics.value(serving, {"engine": "e2", "model_name": MODEL}) == 1
    core.handle(EngineLeft("e2", token2))
    core.handle(Tick())
    assert core.metrics.registry.get_sample_value(serving, {"engine": "e2", "model_name": MODEL}) is None
    assert core.metrics.value(flaps, {"engine": "e2"}) == 3  # stale, fresh, lost while serving


def test_a_tick_writes_only_the_engines_touched_since_the_last(monkeypatch: pytest.MonkeyPatch) -> None:
    """The pass over every engine runs once a second, not every tick (it was
    ~5% of a core at 1,024 engines); between passes a changed report is
    written at the next tick all the same, and the pools with it."""
    core, clock = make_core()
    tokens = {f"e{i}": add_engine(core, f"e{i}") for i in range(8)}
    core.handle(Tick())
    passes: list[int] = []
    whole = FleetGauges._engines

    def counted(self: FleetGauges, engines: list, now: float) -> None:
        passes.append(len(engines))
        whole(self, engines, now)

    monkeypatch.setattr(FleetGauges, "_engines", counted)
    clock.advance(0.1)
    core.handle(Tick())
    assert passes == []
    report_load(core, "e3", tokens["e3"], serving=False)
    clock.advance(0.1)
    core.handle(Tick())
    assert passes == []
    assert core.metrics.value("kvmesh_scheduler_engine_serving", {"engine": "e3", "model_name": MODEL}) == 0
    assert core.metrics.value("kvmesh_scheduler_engine_flaps_total", {"engine": "e3"}) == 1
    assert core.metrics.value("inference_pool_ready_pods", {"name": MODEL}) == 7
    core.handle(EngineLeft("e5", tokens["e5"]))
    clock.advance(0.1)
    core.handle(Tick())
    assert core.metrics.registry.get_sample_value(
        "kvmesh_scheduler_engine_serving", {"engine": "e5", "model_name": MODEL}) is None
    assert core.metrics.value("inference_pool_ready_pods", {"name": MODEL}) == 6
    assert passes == []
    clock.advance(1.0)
    core.handle(Tick())
    assert passes == [7]


def test_reported_prefix_hit_rate_and_pool_gauges() -> None:
    config = make_config()
    config.models = [ModelConfig(name=MODEL, path="unused"), ModelConfig(name="idle", path="unused")]
    core = SchedulerCore(config, FakeClock())
    core.handle(Tick())
    assert core.metrics.value("inference_pool_ready_pods", {"name": "idle"}) == 0  # 0, not absent
    add_engine(core, "e1", total_blocks=100, blocks_used=50, waiting=2, prefix_cache_queries=200,
               prefix_cache_hits=50)
    add_engine(core, "e2", total_blocks=100, blocks_used=10, waiting=0)
    core.handle(Tick())
    m = core.metrics
    assert m.value("kvmesh_scheduler_reported_prefix_hit_rate", {"engine": "e1"}) == 0.25
    assert m.value("kvmesh_scheduler_reported_prefix_hit_rate", {"engine": "e2"}) == 0
    assert m.value("inference_pool_ready_pods", {"name": MODEL}) == 2
    assert m.value("inference_pool_average_kv_cache_utilization", {"name": MODEL}) == 0.3
    assert m.value("inference_pool_average_queue_size", {"name": MODEL}) == 1


def test_oldest_wait_by_class_against_the_aging_bound() -> None:
    core, clock = make_core()
    add_engine(core, "busy", report=False)  # never reported: nothing places
    assert core.metrics.value("kvmesh_scheduler_aging_bound_seconds", {"priority": "P2"}) == 30
    assert core.metrics.value("kvmesh_scheduler_aging_bound_seconds", {"priority": "P1"}) == 30
    admit(core, opts("batch", priority=2))
    clock.advance(12.0)
    admit(core, opts("chat", priority=1))
    clock.advance(3.0)
    core.handle(Tick())
    assert core.metrics.value("kvmesh_scheduler_oldest_wait_seconds", {"priority": "P2"}) == 15
    assert core.metrics.value("kvmesh_scheduler_oldest_wait_seconds", {"priority": "P1"}) == 3
    assert core.metrics.value("kvmesh_scheduler_oldest_wait_seconds", {"priority": "P0"}) == 0


def test_start_time_and_admissions_paused_defaults() -> None:
    before = time.time()
    core, _ = make_core()
    assert before - 1 <= core.metrics.value("kvmesh_scheduler_start_time_seconds") <= time.time()
    for cls in ("P0", "P1", "P2"):
        assert core.metrics.registry.get_sample_value("kvmesh_scheduler_admissions_paused", {"priority": cls}) == 0
