"""Every registered plugin and queue policy against its contract."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest

from services.common.config import ConfigError, PolicyProfileConfig, SchedulerConfig
from services.scheduler.placement import (
    EngineView,
    PickerState,
    PlacementRequest,
    ScoredEngine,
    build_policy,
    builtin_profiles,
    builtin_registry,
)
from services.scheduler.queue_policies import FairnessState, FifoOrdering, RoundRobinTenants
from services.scheduler.records import AdmitOptions, QueueEntry

from .helpers import engine_view

REGISTRY = builtin_registry(SchedulerConfig())
REQUEST = PlacementRequest("r", "m", 64, 16, (1, 2, 3, 4), frozenset({"x3"}))


def view(engine_id: str, **kw: object) -> EngineView:
    fields: dict[str, object] = dict(blocks_used=10, blocks_reserved=5, leases=1, running=1, blocks_needed=5)
    return engine_view(engine_id, **{**fields, **kw})


def varied_views() -> list[EngineView]:
    """Engines across every field's range, extremes included."""
    return [
        view("x0"),
        view("x1", model="other", serving=False, fresh=False, draining=True),
        view("x2", blocks_used=100, blocks_reserved=20, leases=12, running=12, waiting=30,
             queue_seconds=50.0, prefix_blocks=4, max_model_len=32),
        view("x3", weight=3.0, blocks_total=1, blocks_needed=0, prefix_blocks=9, lease_limit=0),
        view("x4", blocks_total=0, blocks_used=0, blocks_reserved=0, queued_tokens=10**9,
             weight=1e-6),
    ]


@pytest.mark.parametrize("name", sorted(REGISTRY.filters))
def test_filter_contract(name: str) -> None:
    plugin = REGISTRY.make_filter(name)
    assert plugin.name == name
    assert plugin.filter(REQUEST, []) == []
    views = varied_views()
    kept = plugin.filter(REQUEST, views)
    assert all(v in views for v in kept)
    assert [v.engine_id for v in kept] == [v.engine_id for v in views if v in kept]  # input order
    assert plugin.filter(REQUEST, views) == kept                                     # pure
    # identical engines (but for the id) pass or fail together
    twins = [view("a"), view("b")]
    assert len(plugin.filter(REQUEST, twins)) in (0, 2)


@pytest.mark.parametrize("name", sorted(REGISTRY.scorers))
def test_scorer_contract(name: str) -> None:
    plugin = REGISTRY.make_scorer(name)
    assert plugin.name == name
    assert dict(plugin.score(REQUEST, [])) == {}
    views = varied_views()
    scores = plugin.score(REQUEST, views)
    assert set(scores) == {v.engine_id for v in views}
    for engine_id, value in scores.items():
        assert 0.0 <= value <= 1.0 and not math.isnan(value), (engine_id, value)
    twins = plugin.score(REQUEST, [view("a"), view("b")])
    assert twins["a"] == twins["b"]


@pytest.mark.parametrize("name", sorted(REGISTRY.pickers))
def test_picker_contract(name: str) -> None:
    plugin = REGISTRY.make_picker(name)
    assert plugin.name == name
    state = PickerState(rng=random.Random(0))
    assert plugin.pick(REQUEST, [], state) is None
    candidates = [ScoredEngine(v, s) for v, s in zip(varied_views(), [0.9, 0.5, 0.5, 0.2, 0.0])]
    for _ in range(5):
        assert plugin.pick(REQUEST, candidates, state) in [c.view for c in candidates]
    ties = [ScoredEngine(view("a"), 0.5), ScoredEngine(view("b"), 0.5)]
    assert plugin.pick(REQUEST, ties, state) in (ties[0].view, ties[1].view)


class _Rogue:
    name = "rogue"

    def score(self, request, engines):
        values = [5.0, -3.0, float("nan")]
        return {e.engine_id: values[i % 3] for i, e in enumerate(engines)}  # x3 missing below


def test_framework_clamps_scores_and_counts_missing_as_zero() -> None:
    policy = build_policy("least_load", SchedulerConfig(), REGISTRY)
    policy.scorers = [(_Rogue(), 1.0)]
    views = varied_views()[:3] + [view("missing")]

    class _Partial(_Rogue):
        def score(self, request, engines):
            return {k: v for k, v in super().score(request, engines).items() if k != "missing"}

    policy.scorers = [(_Partial(), 1.0)]
    scored = {s.view.engine_id: s.score for s in policy.score(REQUEST, views)}
    assert scored == {"x0": 1.0, "x1": 0.0, "x2": 0.0, "missing": 0.0}
    assert list(policy.score(REQUEST, [])) == []


def test_ties_are_broken_by_seeded_shuffle() -> None:
    """Equal scores: not always the first engine, but reproducible per seed."""
    views = [view(f"e{i}") for i in range(6)]

    def first_choices(seed: int) -> list[str]:
        policy = build_policy("least_load", dataclasses.replace(SchedulerConfig(), placement_seed=seed), REGISTRY)
        return [policy.score(REQUEST, views)[0].view.engine_id for _ in range(20)]

    assert first_choices(1) == first_choices(1)
    assert len(set(first_choices(1))) > 1


def test_registry_rejects_duplicates_and_unknown_names() -> None:
    registry = builtin_registry(SchedulerConfig())
    with pytest.raises(ValueError, match="already registered"):
        registry.register_filter("model", registry.filters["model"])
    with pytest.raises(ConfigError, match=r"unknown scorer 'nope'.*registered"):
        registry.make_scorer("nope", "scheduler.policy_profiles.x.scorers")


@pytest.mark.parametrize("name", sorted(builtin_profiles()))
def test_every_builtin_policy_builds_and_places(name: str) -> None:
    policy = build_policy(name, SchedulerConfig(), REGISTRY)
    views = [view("a"), view("b", leases=3)]
    placement = policy.place(REQUEST, views, policy.approx or _NoKv(), 16, 256)
    assert placement is not None and placement.view.engine_id in ("a", "b")
    assert policy.place(REQUEST, [], _NoKv(), 16, 256) is None


class _NoKv:
    def prefix_matches(self, prefix, engines):
        return dict.fromkeys(engines, 0)


BARE = PolicyProfileConfig(filters=["model", "serving"])   # no lease_slots filter at all


@pytest.mark.parametrize("name", [*sorted(builtin_profiles()), "bare"])
def test_no_policy_gives_a_batch_line_a_p0_reserved_slot(name: str) -> None:
    """Whatever the profile's filters, a batch line (at any class it could be
    asked in) never fills an engine's P0-reserved lease slots; an ordinary
    request of the same class may where its class allows."""
    policy = build_policy(name, SchedulerConfig(policy_profiles={"bare": BARE}), REGISTRY)
    last_slots = [view("a", leases=9, lease_limit=10, p0_reserved_leases=1),
                  view("b", leases=8, lease_limit=10, p0_reserved_leases=2)]
    for cls in (0, 1, 2):
        batch = dataclasses.replace(REQUEST, exclude=frozenset(), priority=cls, reserved_slots=False)
        assert policy.place(batch, last_slots, _NoKv(), 16, 256) is None, cls
        assert not any(policy.passes(batch, v) for v in policy.complete_views(batch, last_slots, _NoKv(), 16, 256))
    p0 = dataclasses.replace(REQUEST, exclude=frozenset(), priority=0)
    assert policy.place(p0, last_slots, _NoKv(), 16, 256) is not None
    free = dataclasses.replace(REQUEST, exclude=frozenset(), priority=2, reserved_slots=False)
    assert policy.place(free, [view("c", leases=8, lease_limit=10, p0_reserved_leases=1)], _NoKv(), 16, 256)


def test_custom_profile_from_config() -> None:
    from services.common.config import PolicyProfileConfig

    config = SchedulerConfig(policy_profiles={"mine": PolicyProfileConfig(scorers={"weight": 1.0})})
    assert build_policy("mine", config, REGISTRY).name == "mine"
    bad = SchedulerConfig(policy_profiles={"bad": PolicyProfileConfig(filters=["nope"])})
    with pytest.raises(ConfigError, match=r"policy_profiles.bad.filters"):
        build_policy("bad", bad, REGISTRY)


# ---------------------------------------------------------------- queue policies

def test_queue_policies_register_like_placement_plugins() -> None:
    """Explicit names, duplicates rejected, unknown names are a ConfigError
    naming the setting."""
    assert "round_robin_tenants" in REGISTRY.fairness and "fifo" in REGISTRY.ordering
    registry = builtin_registry(SchedulerConfig())
    with pytest.raises(ValueError, match="already registered"):
        registry.register_fairness(RoundRobinTenants.name, RoundRobinTenants)
    with pytest.raises(ValueError, match="already registered"):
        registry.register_ordering(FifoOrdering.name, FifoOrdering)
    with pytest.raises(ConfigError, match=r"scheduler\.queue_fairness: unknown fairness policy 'nope'"):
        registry.make_fairness("nope")
    with pytest.raises(ConfigError, match=r"scheduler\.queue_ordering: unknown ordering policy 'nope'"):
        registry.make_ordering("nope")


@pytest.mark.parametrize("name", sorted(REGISTRY.fairness))
def test_fairness_policy_contract(name: str) -> None:
    policy = REGISTRY.make_fairness(name)
    assert policy.name == name
    state = FairnessState()
    assert policy.next_tenant(state) is None and policy.rotation(state) == []
    for tenant in ("a", "b", "a", "c"):
        policy.joined(state, tenant)
    assert sorted(policy.rotation(state)) == ["a", "b", "c"]          # each once
    assert policy.next_tenant(state) == policy.rotation(state)[0]
    assert policy.next_tenant(state) == policy.next_tenant(state)     # does not mutate
    first = policy.next_tenant(state)
    policy.served(state, first, still_queued=True)
    assert first in policy.rotation(state) and policy.next_tenant(state) != first
    policy.left(state, "b")
    policy.left(state, "b")                                           # idempotent
    assert "b" not in policy.rotation(state)
    assert policy.next_tenant(state) == policy.rotation(state)[0]
    last = policy.next_tenant(state)
    policy.served(state, last, still_queued=False)                    # its last request
    assert last not in policy.rotation(state)
    for tenant in policy.rotation(state):
        policy.left(state, tenant)
    assert policy.next_tenant(state) is None and policy.rotation(state) == []


@pytest.mark.parametrize("name", sorted(REGISTRY.ordering))
def test_ordering_policy_contract(name: str) -> None:
    policy = REGISTRY.make_ordering(name)
    assert policy.name == name
    entries = [
        QueueEntry(AdmitOptions(request_id=f"r{i}", model="m", prompt_tokens=1), seq=i,
                   arrival=1.0, base_class=1, cls=1, expires_at=9.0)
        for i in range(5)
    ]
    keys = [policy.key(e) for e in entries]
    assert len(set(keys)) == len(keys)                                # distinct on equal arrival
    assert sorted(keys) == keys                                       # then admission order


@pytest.mark.parametrize("setting", ["queue_fairness", "queue_ordering"])
def test_unknown_queue_policy_in_config_names_the_setting(setting: str) -> None:
    from services.common.clock import FakeClock
    from services.scheduler.core import SchedulerCore

    from .helpers import make_config

    with pytest.raises(ConfigError, match=rf"scheduler\.{setting}: unknown .*'nope'.*registered"):
        SchedulerCore(make_config(**{setting: "nope"}), FakeClock())
