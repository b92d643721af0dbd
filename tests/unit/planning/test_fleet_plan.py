"""`kvmesh plan`'s arithmetic (services/planning/): the queue formulas against
their closed forms, the engine's steady state against a step-by-step run of
the same cost model, and the plan's answer against its own neighbours."""

from __future__ import annotations

import argparse
import math
import random

import pytest

from services.common.config import ConfigError, MeshConfig
from services.planning.engine_model import EngineProfile, Workload, steady_state
from services.planning.erlang import Pool, class_wait_quantile, erlang_c
from services.planning.fleet_plan import ClassTarget, Targets, evaluate, plan_fleet
from services.planning.plan_cli import parse_pairs, run
from services.planning.plan_render import render_plan

A100 = EngineProfile("test", fixed_seconds=0.0098, per_sequence_seconds=0.0000294, per_kilotoken_seconds=0.000087,
                     per_prefill_token_seconds=0.0000529, chunk_tokens=512, max_running=128, kv_tokens=467_296)
TARGETS = Targets([ClassTarget("P0", 0.2, 0.5), ClassTarget("P1", 0.5, 2.0), ClassTarget("P2", 0.3, 20.0)],
                  tpot_seconds=0.05)


def test_erlang_c_matches_its_closed_forms() -> None:
    assert erlang_c(1, 0.5) == pytest.approx(0.5)          # M/M/1: rho
    assert erlang_c(2, 1.0) == pytest.approx(1 / 3)        # M/M/2 at rho 1/2
    assert erlang_c(4, 4.0) == 1.0 and erlang_c(3, 0.0) == 0.0
    # thousands of servers: no overflow, and falling with more servers
    assert 0 < erlang_c(4000, 3950.0) < erlang_c(4000, 3990.0) < 1


def test_one_class_wait_quantile_is_m_m_1_exactly() -> None:
    lam, mu = 0.8, 1.0
    # M/M/1: P(W > t) = rho exp(-(mu - lam) t)
    expected = math.log(0.8 / 0.01) / (mu - lam)
    assert class_wait_quantile(Pool(1, lam / mu, 1 / mu), [1.0], 0, 0.99) == pytest.approx(expected)
    assert class_wait_quantile(Pool(1, 0.8, 1.0), [1.0], 0, 0.1) == 0.0   # 80% wait: p10 waits nothing
    assert class_wait_quantile(Pool(1, 1.2, 1.0), [1.0], 0, 0.99) == math.inf


def test_priority_splits_the_wait_high_class_first() -> None:
    waits = [class_wait_quantile(Pool(8, 7.0, 1.0), [0.2, 0.5, 0.3], i, 0.99) for i in range(3)]
    assert waits[0] < waits[1] < waits[2]
    one = class_wait_quantile(Pool(8, 7.0, 1.0), [1.0], 0, 0.99)
    assert waits[0] < one < waits[2]


def test_a_preempting_class_waits_only_for_its_own_load() -> None:
    shares = [0.2, 0.5, 0.3]
    plain = class_wait_quantile(Pool(8, 7.0, 1.0), shares, 0, 0.99)
    preempting = class_wait_quantile(Pool(8, 7.0, 1.0), shares, 0, 0.99, preemptive=True)
    assert preempting < plain
    assert preempting == 0.0  # 1.4 Erlangs on 8 slots: P(wait) < 1%


def test_fixed_service_times_halve_the_wait() -> None:
    exponential = class_wait_quantile(Pool(8, 7.0, 1.0), [1.0], 0, 0.99)
    fixed = class_wait_quantile(Pool(8, 7.0, 1.0, variability=0.5), [1.0], 0, 0.99)
    assert fixed == pytest.approx(exponential / 2)


def test_the_first_token_at_the_quantile_counts_a_whole_prompt_once_misses_pass_it() -> None:
    always = Workload(1, 1000, 100, 0.9, hit_rate=1.0)
    mostly = Workload(1, 1000, 100, 0.9, hit_rate=0.95)
    assert always.prefill_tokens_at(0.99) == pytest.approx(100)
    assert mostly.prefill_tokens_at(0.99) == 1000 and mostly.prefill_tokens_at(0.9) == pytest.approx(100)
    assert mostly.prefill_tokens == pytest.approx(1000 * (1 - 0.9 * 0.95))


def _run_engine(profile: EngineProfile, workload: Workload, rate: float, seconds: float) -> tuple[float, float]:
    """A step-by-step run of the same cost model: Poisson arrivals, each
    prefilled in chunks (batched with the decodes), then one token per step.
    Returns the time-weighted mean batch and the mean step time."""
    rng = random.Random(7)
    a = profile.per_sequence_seconds + profile.per_kilotoken_seconds * workload.mean_context / 1000
    now, next_arrival = 0.0, rng.expovariate(rate)
    prefill_left: list[float] = []
    decoding: list[float] = []  # tokens left
    batch_time = steps_time = 0.0
    steps = 0
    while now < seconds:
        while next_arrival <= now:
            prefill_left.append(workload.prefill_tokens)
            next_arrival += rng.expovariate(rate)
        budget = profile.chunk_tokens - len(decoding)
        chunk = 0.0
        for i, left in enumerate(prefill_left):
            take = min(left, max(0.0, budget - chunk))
            prefill_left[i] -= take
            chunk += take
        done = [i for i, left in enumerate(prefill_left) if left <= 0]
        c = len(decoding)
        step = profile.fixed_seconds + c * a + chunk * profile.per_prefill_token_seconds
        if c == 0 and chunk == 0:
            now = next_arrival
            continue
        batch_time += c * step
        steps_time += step
        steps += 1 if c else 0
        decoding = [d - 1 for d in decoding if d > 1]
        decoding += [workload.output_tokens] * len(done)
        prefill_left = [left for left in prefill_left if left > 0]
        now += step
    return batch_time / steps_time, steps_time / max(steps, 1)


@pytest.mark.parametrize("rate", [4.0, 10.0, 13.0])
def test_the_steady_state_is_what_a_step_by_step_run_settles_at(rate: float) -> None:
    workload = Workload(rate, 1000, 200, 0.5)
    model = steady_state(A100, workload, rate)
    batch, step = _run_engine(A100, workload, rate, seconds=400)
    assert model.stable
    assert model.batch == pytest.approx(batch, rel=0.08)
    assert model.step_seconds == pytest.approx(step, rel=0.08)


def test_an_engine_past_its_capacity_is_unstable() -> None:
    workload = Workload(20, 1000, 200, 0.5)
    assert steady_state(A100, workload, 12).stable
    assert not steady_state(A100, workload, 20).stable
    tiny_kv = EngineProfile(**{**A100.__dict__, "kv_tokens": 10_000})
    assert not steady_state(tiny_kv, workload, 12).stable   # the batch would hold 60k tokens


def test_the_plan_is_the_smallest_fleet_that_meets_every_target() -> None:
    workload = Workload(60, 1000, 200, 0.5)
    plan = plan_fleet(A100, workload, TARGETS)
    assert plan.chosen is not None and plan.chosen.met
    assert plan.below is not None and not plan.below.met
    assert all(evaluate(A100, workload, TARGETS, n).met for n in range(plan.chosen.engines, plan.chosen.engines + 4))
    assert plan.spares >= 1
    double = plan_fleet(A100, Workload(120, 1000, 200, 0.5), TARGETS).chosen
    assert double is not None and double.engines > plan.chosen.engines


def test_a_tpot_target_below_the_fixed_step_is_never_met() -> None:
    plan = plan_fleet(A100, Workload(10, 1000, 200, 0.0),
                      Targets(TARGETS.classes, tpot_seconds=0.005))
    assert plan.chosen is None
    assert "no fleet" in render_plan(plan)


def test_the_rendering_shows_the_arithmetic() -> None:
    text = render_plan(plan_fleet(A100, Workload(60, 1000, 200, 0.5), TARGETS))
    for part in ("ANSWER:", "rho_p =", "Little's law", "ErlangC(k, A)", "one fewer", "spares:"):
        assert part in text


def test_bad_class_pairs_are_clear_errors() -> None:
    assert parse_pairs("P0=0.2, P2=0.8", "--mix") == {"P0": 0.2, "P2": 0.8}
    for bad in ("P9=1", "P0", "P0=x", "P0=-1"):
        with pytest.raises(ConfigError):
            parse_pairs(bad, "--mix")


def test_the_command_answers_and_refuses(capsys: pytest.CaptureFixture[str]) -> None:
    ns = argparse.Namespace(rate=20.0, prompt=1000.0, output=200.0, cached=0.5, hit_rate=1.0, service_cv=1.0,
                            preempting="P0", profile=None, speed_factor=None,
                            mix="P0=0.2,P1=0.8", ttft="P0=0.5,P1=2", quantile=0.99, tpot_ms=0.0, burst=1.25,
                            min_spares=1, json=False)
    assert run(MeshConfig(), ns) == 0
    assert "ANSWER:" in capsys.readouterr().out
    ns.ttft = "P0=0.5"
    assert run(MeshConfig(), ns) == 2
    assert "no target for P1" in capsys.readouterr().out
