"""Workload generation is a pure function of spec + seed."""

from __future__ import annotations

import random
import statistics

import pytest

from services.bench.workloads import (
    Arrival,
    ArrivalSpec,
    WorkloadKind,
    WorkloadSpec,
    arrival_offsets,
    build_workload,
    spec_for,
    zipf_weights,
)


@pytest.mark.parametrize("kind", list(WorkloadKind))
def test_same_seed_same_workload_other_seed_other(kind: WorkloadKind) -> None:
    spec = WorkloadSpec(kind, conversations=40, seed=7, context_tokens=50)
    arrival = ArrivalSpec(Arrival.GAMMA, rate=5.0, gamma_shape=0.5)
    assert build_workload(spec, arrival) == build_workload(spec, arrival)
    other = build_workload(WorkloadSpec(kind, conversations=40, seed=8, context_tokens=50), arrival)
    assert other != build_workload(spec, arrival)


def test_salt_changes_contexts_but_not_arrivals_groups_or_questions() -> None:
    arrival = ArrivalSpec(Arrival.POISSON, rate=5.0)
    a = build_workload(WorkloadSpec(WorkloadKind.SHARED_PREFIX, 30, context_tokens=40), arrival)
    b = build_workload(WorkloadSpec(WorkloadKind.SHARED_PREFIX, 30, context_tokens=40, salt="run 2. "), arrival)
    assert [(c.at, c.group, c.turns) for c in a] == [(c.at, c.group, c.turns) for c in b]
    assert all(x.system != y.system and y.system.startswith("run 2. ") for x, y in zip(a, b))


def test_shared_prefix_groups_share_exactly_one_context_each() -> None:
    convs = build_workload(WorkloadSpec(WorkloadKind.SHARED_PREFIX, 200, groups=4, context_tokens=64),
                           ArrivalSpec(rate=10.0))
    by_group: dict[int, set[str]] = {}
    for c in convs:
        by_group.setdefault(c.group, set()).add(c.system)
        assert len(c.turns) == 1 and c.priority is None
    assert sorted(by_group) == [0, 1, 2, 3] and all(len(s) == 1 for s in by_group.values())
    assert len({c.turns[0].user for c in convs}) == 200  # questions are distinct


def test_context_length_follows_the_token_counter() -> None:
    count = lambda text: len(text.split())  # noqa: E731 - one "token" per word
    convs = build_workload(WorkloadSpec(WorkloadKind.SHARED_PREFIX, 5, groups=2, context_tokens=300),
                           ArrivalSpec(rate=1.0), count)
    assert all(300 <= count(c.system) < 300 + 32 for c in convs)


def test_multi_turn_and_mixed_priority_and_long_output_shapes() -> None:
    arrival = ArrivalSpec(Arrival.CLOSED, concurrency=4)
    chats = build_workload(WorkloadSpec(WorkloadKind.MULTI_TURN, 10, turns=3, think_seconds=0.5), arrival)
    assert all(len(c.turns) == 3 and c.at == 0.0 and c.think_seconds == 0.5 for c in chats)
    mixed = build_workload(WorkloadSpec(WorkloadKind.MIXED_PRIORITY, 2000, priority_mix=(0.2, 0.3, 0.5)),
                           ArrivalSpec(rate=100.0))
    counts = [sum(c.priority == p for c in mixed) / 2000 for p in (0, 1, 2)]
    assert counts == pytest.approx([0.2, 0.3, 0.5], abs=0.04)
    longs = build_workload(WorkloadSpec(WorkloadKind.LONG_OUTPUT, 1000, long_fraction=0.25,
                                        long_max_tokens=300, max_tokens=10), ArrivalSpec(rate=100.0))
    share = sum(c.turns[0].max_tokens == 300 for c in longs) / 1000
    assert share == pytest.approx(0.25, abs=0.05)
    assert {c.turns[0].max_tokens for c in longs} == {10, 300}


@pytest.mark.parametrize("kind,shape", [(Arrival.POISSON, 1.0), (Arrival.GAMMA, 0.25), (Arrival.GAMMA, 4.0)])
def test_open_loop_arrivals_have_the_asked_rate_and_burstiness(kind: Arrival, shape: float) -> None:
    offsets = arrival_offsets(ArrivalSpec(kind, rate=20.0, gamma_shape=shape), 20000, random.Random(3))
    gaps = [b - a for a, b in zip([0.0, *offsets], offsets)]
    assert statistics.mean(gaps) == pytest.approx(1 / 20.0, rel=0.05)
    cv = statistics.stdev(gaps) / statistics.mean(gaps)
    assert cv == pytest.approx(1 / shape**0.5, rel=0.1)
    assert offsets == sorted(offsets)


def test_invalid_specs_are_refused() -> None:
    with pytest.raises(ValueError):
        WorkloadSpec(WorkloadKind.SHARED_PREFIX, 0)
    with pytest.raises(ValueError):
        WorkloadSpec(WorkloadKind.MIXED_PRIORITY, 5, priority_mix=(0.0, 0.0, 0.0))
    with pytest.raises(ValueError):
        ArrivalSpec(Arrival.POISSON, rate=0.0)
    with pytest.raises(ValueError):
        ArrivalSpec(Arrival.CLOSED, concurrency=0)


def test_cache_pressure_defaults_are_the_benchmark_shape_and_overrides_win() -> None:
    spec = spec_for(WorkloadKind.CACHE_PRESSURE, 10)
    assert (spec.groups, spec.context_tokens, spec.turns, spec.max_tokens, spec.zipf) == (64, 3000, 4, 32, 0.8)
    # Distinct context total: several times one engine's KV (640 x 16 = 10,240) and past the fleet's 81,920.
    assert spec.groups * spec.context_tokens > 2 * 8 * 640 * 16
    tuned = spec_for(WorkloadKind.CACHE_PRESSURE, 10, groups=5, zipf=None, seed=3)
    assert (tuned.groups, tuned.zipf, tuned.seed) == (5, 0.8, 3)
    assert spec_for(WorkloadKind.SHARED_PREFIX, 10, groups=None) == WorkloadSpec(WorkloadKind.SHARED_PREFIX, 10)


def test_cache_pressure_contexts_vary_in_length_and_groups_follow_zipf() -> None:
    count = lambda text: len(text.split())  # noqa: E731 - one "token" per word
    spec = spec_for(WorkloadKind.CACHE_PRESSURE, 3000, groups=6, context_tokens=300, context_spread=0.5)
    convs = build_workload(spec, ArrivalSpec(rate=50.0), count)
    contexts = {c.group: c.system for c in convs}
    assert sorted(contexts) == list(range(6)) and all(c.system == contexts[c.group] for c in convs)
    lengths = [count(t) for t in contexts.values()]
    assert all(150 <= n <= 450 for n in lengths) and len(set(lengths)) > 1
    shares = [sum(c.group == g for c in convs) / len(convs) for g in range(6)]
    assert shares == pytest.approx(zipf_weights(6, 0.8), abs=0.03)
    assert shares[0] > 2 * shares[5]  # skewed: 6**0.8 = 4.2x


def test_cache_pressure_sessions_grow_over_distinct_turns() -> None:
    convs = build_workload(spec_for(WorkloadKind.CACHE_PRESSURE, 20, groups=4, context_tokens=40, turns=3),
                           ArrivalSpec(rate=5.0))
    assert all(len(c.turns) == 3 and c.think_seconds == 1.0 and c.priority is None for c in convs)
    users = [t.user for c in convs for t in c.turns]
    assert len(set(users)) == len(users) and all(t.max_tokens == 32 for c in convs for t in c.turns)
    with pytest.raises(ValueError):
        WorkloadSpec(WorkloadKind.CACHE_PRESSURE, 5, zipf=-1.0)


def test_cache_pressure_contexts_do_not_depend_on_sessions_or_arrivals() -> None:
    spec = spec_for(WorkloadKind.CACHE_PRESSURE, 30, groups=3, context_tokens=40)
    few = build_workload(spec_for(WorkloadKind.CACHE_PRESSURE, 5, groups=3, context_tokens=40),
                         ArrivalSpec(Arrival.GAMMA, rate=1.0, gamma_shape=0.3))
    many = build_workload(spec, ArrivalSpec(rate=9.0))
    assert {c.group: c.system for c in few}.items() <= {c.group: c.system for c in many}.items()
