"""The scaling policy (services/scheduler/scaling/) on fake clocks: Little's
law in the steady state, a step out on a queue-wait miss, hysteresis on the
way in, the step bound and the clamp."""

from __future__ import annotations

import math

from services.common.clock import FakeClock
from services.common.config import ScalingConfig
from services.planning.engine_model import EngineProfile
from services.scheduler.events import RequestArrived, Tick
from services.scheduler.scaling import Need, Stepper, need
from services.scheduler.scaling.demand import DemandMeter, ModelDemand
from services.scheduler.scaling.signals import ModelSupply, QueueSignal

from .helpers import MODEL, add_engine, make_core, opts

# Decode only, no per-sequence cost: a step is 10 ms whatever the batch, so a
# 100-token answer holds a batch slot 1 s (W) and Little's law puts rate x 1 s
# requests in the batches (L = lambda W).
FLAT = EngineProfile("flat", 0.01, 0.0, 0.0, 0.0, 512, 8, 0)
LOOSE = ScalingConfig(ttft_targets_seconds=[1000.0, 1000.0, 1000.0])


def demand(rate: float, output: float = 100.0, shares: tuple[float, ...] = (0.0, 1.0, 0.0)) -> ModelDemand:
    d = ModelDemand(prompt_tokens=0.0, output_tokens=output)
    d.fast = [rate * s for s in shares]
    d.slow = list(d.fast)
    return d


def supply(serving: int, profile: EngineProfile | None = FLAT, kv_use: float = 0.0) -> ModelSupply:
    return ModelSupply(serving, serving, kv_use, 1.0, 8, profile)


NO_QUEUE = QueueSignal([0, 0, 0], [0.0, 0.0, 0.0])


def test_steady_state_is_littles_law() -> None:
    for rate in (4.0, 40.0, 80.0):
        got = need(demand(rate), supply(2), NO_QUEUE, LOOSE).engines
        little = math.ceil(rate * 1.0 / 8)          # L = lambda W over 8 slots per engine
        assert little <= got <= little + 1, (rate, got)
        assert got >= 1
    assert need(demand(40.0), supply(2), NO_QUEUE, LOOSE).reason.startswith("steady state: 40.00 req/s")


def test_tighter_targets_need_more_engines_than_little() -> None:
    tight = ScalingConfig(ttft_targets_seconds=[0.05, 0.05, 0.05])
    assert need(demand(40.0), supply(2), NO_QUEUE, tight).engines > need(demand(40.0), supply(2), NO_QUEUE,
                                                                          LOOSE).engines


def test_no_load_needs_nothing_but_queued_work_needs_one() -> None:
    assert need(demand(0.0), supply(0, None), NO_QUEUE, LOOSE).engines == 0
    queued = QueueSignal([0, 3, 0], [0.0, 0.1, 0.0])
    got = need(demand(0.0), supply(0, None), queued, LOOSE)
    assert got.engines == 1 and ("queue" in got.reason or "demand" in got.reason)


def test_a_queue_wait_miss_adds_one_over_the_serving_engines() -> None:
    config = ScalingConfig(ttft_targets_seconds=[0.5, 2.0, 20.0])
    missed = QueueSignal([2, 0, 0], [0.7, 0.0, 0.0])    # a P0 waited 0.7 s > 0.5 s
    got = need(demand(0.1, shares=(1.0, 0.0, 0.0)), supply(3), missed, config)
    assert got.engines == 4 and got.reason.startswith("queue: P0 waited 0.70 s")
    fine = QueueSignal([0, 0, 5], [0.0, 0.0, 10.0])     # P2 under its 20 s: no step
    assert need(demand(0.1), supply(3), fine, config).engines < 4


def test_kv_pressure_adds_one() -> None:
    got = need(demand(0.1), supply(2, kv_use=0.95), NO_QUEUE, LOOSE)
    assert got.engines == 3 and got.reason.startswith("KV pressure")


def test_out_fast_within_the_step_bound_and_the_clamp() -> None:
    config = ScalingConfig(min_engines=1, max_engines=5, max_step_up=2)
    s = Stepper()
    assert s.step(Need(9, "burst"), 1, config, 0.0)[0] == 3          # +2 per decision
    assert s.step(Need(9, "burst"), 3, config, 5.0)[0] == 5          # then the max
    assert s.step(Need(9, "burst"), 5, config, 10.0)[0] == 5         # clamped
    low = Stepper()
    assert low.step(Need(0, "idle"), 0, config, 0.0)[0] == 1         # never below min


def test_in_slowly_after_the_hold_one_step_per_decision() -> None:
    config = ScalingConfig(scale_in_hold_seconds=60.0, max_step_down=1)
    s = Stepper(desired=4)
    assert s.step(Need(1, "lull"), 4, config, 0.0) [0] == 4
    desired, reason = s.step(Need(1, "lull"), 4, config, 30.0)
    assert desired == 4 and reason.startswith("holding")
    assert s.step(Need(1, "lull"), 4, config, 60.0)[0] == 3
    assert s.step(Need(1, "lull"), 3, config, 65.0)[0] == 2
    # A need back up resets the hold: the next lull waits the whole hold again.
    assert s.step(Need(2, "busy"), 2, config, 70.0)[0] == 2
    assert s.step(Need(1, "lull"), 2, config, 75.0)[0] == 2
    assert s.step(Need(1, "lull"), 2, config, 130.0)[0] == 2
    assert s.step(Need(1, "lull"), 2, config, 135.0)[0] == 1


def test_no_scale_in_while_the_queue_misses() -> None:
    config = ScalingConfig(scale_in_hold_seconds=10.0)
    s = Stepper(desired=4)
    for t in (0.0, 20.0, 40.0):     # the rate fell, but the queue still misses: engines may still be starting
        assert s.step(Need(2, "queue: P1 waited 9 s", missing=True), 1, config, t)[0] == 4
    assert s.step(Need(2, "lull"), 4, config, 45.0)[0] == 4      # the hold starts only now
    assert s.step(Need(2, "lull"), 4, config, 55.0)[0] == 3
    missed = QueueSignal([0, 4, 0], [3.0, 3.0, 0.0])
    got = need(demand(40.0), supply(1), missed, ScalingConfig(ttft_targets_seconds=[0.5, 2.0, 20.0]))
    assert got.missing


def test_the_demand_meter_follows_a_rate_by_time_constant() -> None:
    meter = DemandMeter(fast_seconds=10.0, slow_seconds=60.0, now=0.0)
    for second in range(1, 61):
        for _ in range(10):
            meter.arrived(MODEL, 1, 100, 50)
        meter.roll(float(second))
    d = meter.get(MODEL)
    assert 9.9 < d.fast[1] <= 10.0 and 6.0 < d.slow[1] < 6.5      # 1 - e^-1 of the way after one slow constant
    assert d.prompt_tokens == 100 and d.output() == 50             # max_tokens until usage is told
    meter.finished(MODEL, 100, 20, 50)
    assert d.output() == 20 and d.cached_fraction == 0.5


def test_the_core_publishes_desired_engines_per_interval() -> None:
    core, clock = make_core(clock=FakeClock())
    token = add_engine(core, "e1", max_running=8)
    assert core.fleet.get("e1") is not None and token
    for i in range(50):      # 10 req/s for 5 s
        core.handle(RequestArrived(opts(f"r{i}", max_tokens=16)))
        clock.advance(0.1)
    core.handle(Tick())
    [decision] = [d for d in core.state().scaling if d.model == MODEL]
    assert decision.current == 1 and decision.desired >= 1 and decision.reason
    assert core.metrics.value("kvmesh_scheduler_desired_engines", {"model": MODEL}) == decision.desired


def test_unreachable_targets_fall_back_to_keeping_up_within_max() -> None:
    slow_prefill = EngineProfile("slow prefill", 0.01, 0.0, 0.0, 0.01, 512, 8, 0)   # 10 ms per prompt token
    config = ScalingConfig(ttft_targets_seconds=[0.5, 0.5, 0.5], max_engines=16)
    d = demand(4.0)
    d.prompt_tokens = 200.0                       # a 2 s prefill: no fleet meets 0.5 s
    got = need(d, supply(2, slow_prefill), NO_QUEUE, config)
    assert 1 <= got.engines <= 16 and "out of reach" in got.reason


def test_a_model_nobody_configured_or_serves_is_not_counted() -> None:
    core, clock = make_core(clock=FakeClock())
    for i in range(20):
        core.handle(RequestArrived(opts(f"r{i}", model=f"random-{i}")))
    clock.advance(6.0)
    core.handle(Tick())
    assert core.state().scaling == []
