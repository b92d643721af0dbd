"""Placement over indexed candidates (placement/candidates.py, fleet_index.py)
against the full scan: the same engine when the full scan's winner is a
candidate by construction, and within the stated bound otherwise; the
indexes kept right as reports and leases change."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.common.config import ConfigError, MeshConfig, validate_config
from services.scheduler.core import SchedulerCore
from services.scheduler.engine_registry import EngineInfo
from services.scheduler.events import (
    DrainRequested,
    EngineDrainSet,
    EngineJoined,
    EngineLeft,
    KvSnapshotReported,
    RequestArrived,
    RequestDone,
    Tick,
)
from services.scheduler.kv_index import KvIndex
from services.scheduler.placement import EngineView, PlacementRequest
from services.scheduler.placement.candidates import ORDER_KEYS, plan_for
from services.scheduler.placement.live import LiveWorkingSet
from services.scheduler.placement.predicted import _TIE_SECONDS, predicted_ttft

from .helpers import MODEL, add_engine, engine_view, make_core, opts, placed_engine, report_load

K = 3
PROMPT = 2032
PREFIXES = [tuple(range(g * 1000, g * 1000 + 125)) for g in range(3)]   # three 2,000-token contexts
MAX_SCORE = ["least_load", "kv_precise"]
PREDICTED = ["predicted_ttft", "predicted_ttft_plain"]
FALLBACK = 20000.0


def _engine(rng: random.Random, mixed: bool) -> dict[str, Any]:
    """One engine's hello and report: homogeneous (one speed, size, weight) or mixed."""
    total = rng.choice((2048, 4096, 8192)) if mixed else 4096
    max_running = rng.choice((4, 8, 16)) if mixed else 8
    return dict(
        total_blocks=total, max_running=max_running, weight=rng.choice((0.5, 1.0, 2.0)) if mixed else 1.0,
        serving=rng.random() > 0.1, running=rng.randint(0, max_running), waiting=rng.randint(0, 3),
        blocks_used=rng.randint(0, total // 2), cached_blocks=rng.randint(0, total // 2),
        queued_tokens=rng.randint(0, 60000),
        prefill_tokens_per_second=rng.uniform(2000, 9000) if mixed else 4700.0,
        step_seconds=rng.uniform(0.01, 0.08) if mixed else 0.04,
        step_token_budget=rng.choice((0, 512, 2048)) if mixed else 0,
    )


Fleet = list[tuple[str, dict[str, Any], tuple[int, ...], dict[str, Any]]]
_HELLO = ("total_blocks", "max_running", "weight")


def _fleet(seed: int, n: int, mixed: bool) -> Fleet:
    """n engines: their first fields, the prefix blocks each caches (some
    none), and a later report (the index must follow it)."""
    rng = random.Random(seed)
    fleet = []
    for i in range(n):
        held: tuple[int, ...] = ()
        if rng.random() < 0.3:
            held = rng.choice(PREFIXES)[: rng.randint(1, 125)]
        first = _engine(rng, mixed)
        later = {k: v for k, v in _engine(rng, mixed).items() if k not in _HELLO}
        later["running"] = min(later["running"], first["max_running"])
        later["blocks_used"] = min(later["blocks_used"], first["total_blocks"] // 2)
        later["cached_blocks"] = min(later["cached_blocks"], first["total_blocks"] // 2)
        fleet.append((f"e{i:03d}", first, held, later))
    return fleet


def _core(policy: str, candidates: int, fleet: Fleet) -> SchedulerCore:
    """A core with `fleet` joined and reported, whose first figures were
    built (one probe) before every engine reported again."""
    core, _ = make_core(policy=policy, placement_candidates=candidates)
    tokens = {}
    for engine_id, fields, held, _later in fleet:
        tokens[engine_id] = add_engine(core, engine_id, **fields)
        core.handle(KvSnapshotReported(engine_id, tokens[engine_id], 1, list(held)))
    if core.policy.plan is not None and len(fleet) > 2 * candidates:
        _candidates(core, PlacementRequest("probe", MODEL, PROMPT, 16))
    for engine_id, _fields, _held, later in fleet:
        report_load(core, engine_id, tokens[engine_id], **later)
    return core


def _request(seed: int) -> PlacementRequest:
    rng = random.Random(seed ^ 0x5EED)
    prefix = rng.choice(PREFIXES) + (rng.getrandbits(60), rng.getrandbits(60)) if rng.random() < 0.7 else ()
    return PlacementRequest("r", MODEL, PROMPT, 16, prefix)


def _place(core: SchedulerCore, request: PlacementRequest) -> str | None:
    options = opts(request.request_id, prompt_tokens=request.prompt_tokens, max_tokens=request.max_tokens,
                   prefix_hashes=request.prefix_hashes)
    return placed_engine(core.handle(RequestArrived(options)).notices, request.request_id)


def _candidates(core: SchedulerCore, request: PlacementRequest) -> set[str]:
    policy = core.policy
    views = core.fleet.candidate_views(request, policy.plan, policy.prefix_holders(core.fleet.kv),
                                       core._clock.monotonic())
    assert views is not None, "a fleet over 2 K engines is placed from candidates"
    return {v.engine_id for v in views}


def _completed(core: SchedulerCore, request: PlacementRequest) -> list[EngineView]:
    """Every engine as the full scan completes and filters it."""
    policy, config = core.policy, core._config
    views = policy.complete_views(request, core.fleet.views(MODEL, core._clock.monotonic()), core.fleet.kv,
                                  16, config.decode_headroom_tokens)
    for f in policy.filters:
        views = f.filter(request, views)
    return views


# ------------------------------------------------------------ equivalence


@pytest.mark.parametrize("policy", MAX_SCORE + PREDICTED + ["sticky_until_saturated"])
def test_indexed_choice_is_the_full_scans_when_its_winner_is_a_candidate(policy: str) -> None:
    """Seeded random fleets of 10-40 engines: whenever the full scan's
    choice is among the candidates, the indexed choice is the same engine.
    With one speed across the model (homogeneous fleets) predicted_ttft's
    winner is a candidate by construction (the first of the "ready" figure,
    or a warm engine): always."""
    among = placed = 0
    trials = 40
    for seed in range(trials):
        fleet, request = _fleet(seed, 10 + seed % 31, mixed=False), _request(seed)
        full, indexed = _core(policy, 0, fleet), _core(policy, K, fleet)
        winner = _place(full, request)
        candidates = _candidates(indexed, request)
        chosen = _place(indexed, request)
        if winner is None:
            assert chosen is None
            continue
        placed += 1
        if winner in candidates:
            among += 1
            assert chosen == winner, (seed, sorted(candidates))
    if policy in PREDICTED:
        assert among == placed
    assert among >= placed * 0.6 > 0, f"the winner was a candidate in only {among} of {placed} fleets"


def test_a_small_model_an_unknown_figure_and_round_robin_scan_every_engine() -> None:
    core = _core("predicted_ttft", K, _fleet(1, 2 * K, mixed=False))
    request = _request(1)
    assert core.fleet.candidate_views(request, core.policy.plan, core.policy.prefix_holders(core.fleet.kv),
                                      0.0) is None
    assert plan_for(["load"], "round_robin", ["model"], 8) is None
    assert plan_for(["my_scorer"], "max_score", ["model"], 8) is None
    assert plan_for(["load"], "max_score", ["model"], 0) is None
    plan = plan_for(["load", "kv_usage", "cache_spread"], "predicted_ttft", ["model", "fresh", "has_room"], 8)
    assert plan is not None and plan.orders == ("load", "kv_fill", "cache_fill", "ready")
    assert plan.checks == frozenset({"fresh", "has_room"})


def test_placement_candidates_must_not_be_negative() -> None:
    config = MeshConfig()
    config.scheduler.placement_candidates = -1
    with pytest.raises(ConfigError, match=r"scheduler\.placement_candidates"):
        validate_config(config)


# ------------------------------------------------------------ the bound


def _top_k_hold(core: SchedulerCore, request: PlacementRequest, candidates: set[str]) -> dict[str, float]:
    """For each figure of the plan, the K-th best key among engines passing the
    filters; asserts that no engine outside the candidates beats it (the
    index holds the true K best, however the reports changed)."""
    assert core.policy.plan is not None
    passing = _completed(core, request)
    boundary = {}
    for name in core.policy.plan.orders:
        keys = sorted(ORDER_KEYS[name](v, FALLBACK) for v in passing if v.engine_id in candidates)
        boundary[name] = keys[min(K, len(keys)) - 1] if keys else float("inf")
        for v in passing:
            if v.engine_id not in candidates:
                assert ORDER_KEYS[name](v, FALLBACK) >= boundary[name], (name, v.engine_id)
    return boundary


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31), policy=st.sampled_from(MAX_SCORE), n=st.integers(10, 40))
def test_max_score_choice_is_within_the_bound_of_the_best(seed: int, policy: str, n: int) -> None:
    """Mixed fleets: the full scan's best score is at most max(chosen, U),
    U = what an engine outside the candidates can score at most."""
    fleet, request = _fleet(seed, n, mixed=True), _request(seed)
    core = _core(policy, K, fleet)
    candidates = _candidates(core, request)
    boundary = _top_k_hold(core, request, candidates)
    chosen = _place(_core(policy, K, fleet), request)
    views = _completed(core, request)
    if not views:
        assert chosen is None
        return
    scores = {s.view.engine_id: s.score for s in core.policy.score(request, views)}
    best_ratio = min(ORDER_KEYS["load"](v, FALLBACK) for v in views)
    weights = {s.name: w for s, w in core.policy.scorers}
    ceiling = {"load": min(1.0, best_ratio / boundary["load"]), "kv_usage": 1.0 - boundary["kv_fill"],
               "prefix": 0.0 if len({v.engine_id for v in views if v.prefix_blocks}) <= K else 1.0}
    outside = sum(w * ceiling[name] for name, w in weights.items()) / sum(weights.values())
    assert chosen is not None
    assert max(scores.values()) <= max(scores[chosen], outside) + 1e-9


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31), n=st.integers(10, 40))
def test_predicted_ttft_choice_is_within_the_bound_of_the_full_scans(seed: int, n: int) -> None:
    """Mixed speeds: the indexed choice's predicted TTFT exceeds the full
    scan's choice's by at most 2 x margin + the tie window + the gap between
    the best cold candidate and the least any other engine could cost
    (its "ready" figure + the prompt at the fastest speed)."""
    fleet, request = _fleet(seed, n, mixed=True), _request(seed)
    probe = _core("predicted_ttft_plain", K, fleet)
    candidates = _candidates(probe, request)
    boundary = _top_k_hold(probe, request, candidates)
    winner = _place(_core("predicted_ttft_plain", 0, fleet), request)
    chosen = _place(_core("predicted_ttft_plain", K, fleet), request)
    if winner is None:
        assert chosen is None
        return
    views = {v.engine_id: v for v in _completed(probe, request)}
    cost = {e: predicted_ttft(request, v, FALLBACK) for e, v in views.items()}   # plain: no eviction charge
    fastest = max(v.prefill_tokens_per_second for v in views.values())
    least_outside = boundary["ready"] + request.prompt_tokens / fastest
    for e in views:
        if e not in candidates:
            assert cost[e] >= least_outside - 1e-9
    cold = [cost[e] for e in candidates if e in views and not views[e].prefix_blocks]
    gap = max(0.0, min(cold, default=least_outside) - least_outside)
    margin = probe._config.predicted_ttft_margin_seconds
    assert chosen is not None
    assert cost[chosen] <= cost[winner] + 2 * margin + _TIE_SECONDS + gap + 1e-9


# ------------------------------------------------------------ upkeep


def test_index_follows_reports_leases_and_departures() -> None:
    """The K least loaded by each figure as reports arrive, leases open and
    engines leave or change model -- never a stale order."""
    core, _ = make_core(policy="least_load", placement_candidates=2)
    tokens = {f"e{i}": add_engine(core, f"e{i}", running=i % 8, blocks_used=10 * i) for i in range(12)}
    request = PlacementRequest("probe", MODEL, 32, 16)
    # least_load ranks on load (e0, e8 idle: the first two) and KV fill (e0, e1 the emptiest)
    assert _candidates(core, request) == {"e0", "e8", "e1"}
    report_load(core, "e0", tokens["e0"], running=8, blocks_used=900)
    report_load(core, "e11", tokens["e11"], running=0, blocks_used=0)
    assert _candidates(core, request) == {"e1", "e8", "e11"}
    placed = _place(core, PlacementRequest("x", MODEL, 32, 16))
    assert placed in {"e1", "e8", "e11"}
    core.handle(EngineLeft("e11", tokens["e11"]))
    add_engine(core, "e11", model="other")       # the same id, another model
    assert "e11" not in _candidates(core, request)
    for engine_id in ("e1", "e8"):
        report_load(core, engine_id, tokens[engine_id], serving=False)
    assert _candidates(core, request).isdisjoint({"e1", "e8", "e11"})


@settings(max_examples=200, deadline=None)
@given(held=st.lists(st.lists(st.integers(0, 11), max_size=12), max_size=6),
       asked=st.lists(st.integers(0, 7), max_size=8), prefix=st.lists(st.integers(0, 12), max_size=12))
def test_prefix_matches_counts_each_engines_leading_hashes(
    held: list[list[int]], asked: list[int], prefix: list[int],
) -> None:
    """The KV index's match (each engine written once, when it drops out)
    against the definition: the leading hashes of the prefix it holds."""
    index = KvIndex()
    for i, hashes in enumerate(held):
        index.apply_snapshot(f"e{i}", 1, hashes)
    engines = [f"e{i}" for i in asked]
    expected = {}
    for e in engines:
        n = 0
        while n < len(prefix) and index.holds(e, prefix[n]):
            n += 1
        expected[e] = n
    assert index.prefix_matches(prefix, engines) == expected


@settings(max_examples=100, deadline=None)
@given(steps=st.lists(st.tuples(st.sampled_from([0.0, 0.5, 1.5, 4.5]), st.integers(0, 3),
                                st.lists(st.integers(0, 20), max_size=8), st.booleans()), max_size=30))
def test_live_set_ages_out_without_scanning_the_engines(steps: list[tuple[float, int, list[int], bool]]) -> None:
    """The live working set (ageing from its placement log) against its
    definition: per engine, the distinct hashes placed there within the
    window since it was last forgotten."""
    now = [0.0]
    live = LiveWorkingSet(4.0, capacity=10**6, clock=lambda: now[0])
    log: list[tuple[float, str, list[int]]] = []
    for advance, engine, hashes, forget in steps:
        now[0] += advance
        engine_id = f"e{engine}"
        if forget:
            live.forget_engine(engine_id)
            log = [entry for entry in log if entry[1] != engine_id]
        else:
            live.add(tuple(hashes), engine_id)
            log.append((now[0], engine_id, hashes))
        expected = {f"e{i}": len({h for t, e, hs in log if e == f"e{i}" and t >= now[0] - 4.0 for h in hs})
                    for i in range(4)}
        assert live.live_hashes(list(expected)) == expected


def _full_and_small(total_big: int) -> tuple[SchedulerCore, dict[str, int]]:
    """40 idle small engines short of room for a 2,400-token prompt (140
    free blocks, 150 needed) and one busy big one, last in every figure."""
    core, _ = make_core(policy="least_load", placement_candidates=2)
    tokens = {f"s{i:02d}": add_engine(core, f"s{i:02d}", total_blocks=200, blocks_used=60) for i in range(40)}
    tokens["big"] = add_engine(core, "big", total_blocks=total_big, blocks_used=total_big // 2, running=6)
    return core, tokens


def test_when_no_candidate_has_room_the_others_that_might_are_placed_on() -> None:
    core, _ = _full_and_small(total_big=10000)
    request = PlacementRequest("r", MODEL, 2400, 16)
    assert "big" not in _candidates(core, request)
    assert _place(core, request) == "big"     # as the full scan: the only engine with room


def test_a_fleet_without_room_is_screened_not_scanned(monkeypatch: pytest.MonkeyPatch) -> None:
    core, _ = _full_and_small(total_big=200)
    _candidates(core, PlacementRequest("probe", MODEL, 32, 16))     # figures built
    built: list[str] = []
    view_of = core.fleet._view

    def counted(record: Any, now: float) -> EngineView:
        built.append(record.engine_id)
        return view_of(record, now)

    monkeypatch.setattr(core.fleet, "_view", counted)
    assert _place(core, PlacementRequest("r", MODEL, 2400, 16)) is None    # queued: no engine has room
    assert len(built) <= 4, "only the candidates' views are built"
    assert core.fleet.views(MODEL, 0.0)  # (the full scan would have built all 41)


_OPS = st.lists(st.tuples(st.sampled_from(["join", "rejoin", "report", "admit", "done", "leave", "drain", "admin",
                                           "tick"]),
                          st.integers(0, 7), st.integers(0, 2**20)), max_size=40)


@settings(max_examples=40, deadline=None)
@given(ops=_OPS)
def test_every_figure_matches_the_engines_views_after_any_events(ops: list[tuple[str, int, int]]) -> None:
    """Joins, new incarnations, reports, leases opened and ended, departures,
    drains: after each, the index's key of every engine for every figure is
    the one its view now gives, and so is the view decisions read (no
    change of an engine goes unmarked)."""
    core, clock = make_core(policy="predicted_ttft", placement_candidates=1)
    tokens: dict[str, int] = {}
    incarnation: dict[str, int] = {}
    admitted: list[str] = []
    for i in range(3):
        tokens[f"e{i}"] = add_engine(core, f"e{i}")
    for step, (op, n, value) in enumerate(ops):
        engine_id, rng = f"e{n}", random.Random(value)
        if op in ("join", "rejoin") and (op == "join") != (engine_id in tokens):
            incarnation[engine_id] = incarnation.get(engine_id, 0) + 1
            info = EngineInfo(engine_id, f"{engine_id}:1", MODEL, 16, rng.choice((500, 1000, 4000)),
                              rng.randint(1, 8), 1.0, 0, incarnation=incarnation[engine_id])
            tokens[engine_id] = core.handle(EngineJoined(info)).token
        elif op == "report" and engine_id in tokens:
            fields = _engine(rng, mixed=True)
            for hello in _HELLO:
                fields.pop(hello)
            fields["blocks_used"] = fields["cached_blocks"] = rng.randint(0, 300)
            report_load(core, engine_id, tokens[engine_id], **fields)
        elif op == "admit":
            request_id = f"r{step}"
            core.handle(RequestArrived(opts(request_id, priority=n % 3, prompt_tokens=rng.randint(16, 3000),
                                            prefix_hashes=rng.choice(PREFIXES)[:8])))
            admitted.append(request_id)
        elif op == "done" and admitted:
            core.handle(RequestDone(admitted.pop(value % len(admitted))))
        elif op == "leave" and engine_id in tokens:
            core.handle(EngineLeft(engine_id, tokens.pop(engine_id)))
        elif op == "drain":
            core.handle(DrainRequested(engine_id))
        elif op == "admin":
            core.handle(EngineDrainSet(engine_id, drained=value % 2 == 0, move=value % 3 == 0))
        elif op == "tick":
            clock.advance(1.5)    # two ticks without a report: stale
            core.handle(Tick())
        _candidates_or_none(core)
        _assert_keys_current(core)


def _candidates_or_none(core: SchedulerCore) -> None:
    """Any decision re-keys what changed (this one only asks for candidates)."""
    policy = core.policy
    core.fleet.candidate_views(PlacementRequest("probe", MODEL, 32, 16), policy.plan,
                               policy.prefix_holders(core.fleet.kv), core._clock.monotonic())


def _assert_keys_current(core: SchedulerCore) -> None:
    index, now = core.fleet._index, core._clock.monotonic()
    members = set(index.members(MODEL))
    assert members == {e.engine_id for e in core.fleet if e.info.model == MODEL}
    model = index._models.get(MODEL)
    if model is None:
        return
    for name, keys in model.keys.items():
        assert set(keys) == members
        entries = model.orders[name]
        assert entries == sorted(entries) and len(entries) == len(members)
        for engine_id in members:
            view = core.fleet._view(core.fleet._registry[engine_id], now)
            assert keys[engine_id] == ORDER_KEYS[name](view, FALLBACK), (name, engine_id)
    for engine_id in members:   # and the views decisions read are the ones a full scan builds
        assert core.fleet._current(engine_id, now) == core.fleet._view(core.fleet._registry[engine_id], now)
    # The engines with a free slot (the pools a decision looks in) are the ones the views say.
    views = {e: core.fleet._view(core.fleet._registry[e], now) for e in members}
    assert model.open == {e for e, v in views.items() if v.leases < v.lease_limit}
    assert model.open_unreserved == {e for e, v in views.items() if v.unreserved_room()}


def test_the_ready_figure_is_a_p0s_prediction_when_batch_lines_make_it_shorter() -> None:
    """A P0 runs ahead of batch lines (fleet.py: p0_queue_seconds): the
    figure is what an empty P0 prompt is predicted there -- a lower bound for
    every class -- so an engine full of batch lines is not ranked out for it."""
    busy = engine_view("b", queued_tokens=4000, queue_seconds=4000 / FALLBACK + 3.0,
                       p0_queue_seconds=4000 / FALLBACK + 0.5, prefill_tokens_per_second=4700.0, step_seconds=0.04)
    empty = PlacementRequest("r", MODEL, 0, 16, priority=0)
    as_p0 = predicted_ttft(empty, dataclasses.replace(busy, queue_seconds=4000 / FALLBACK + 0.5), FALLBACK)
    assert ORDER_KEYS["ready"](busy, FALLBACK) == pytest.approx(as_p0)
    assert ORDER_KEYS["ready"](busy, FALLBACK) < predicted_ttft(empty, busy, FALLBACK)


def test_a_nan_in_a_report_sorts_last_and_keeps_the_figures_ordered() -> None:
    core, _ = make_core(policy="predicted_ttft", placement_candidates=1)
    tokens = {f"e{i}": add_engine(core, f"e{i}", queued_tokens=1000 * i, prefill_tokens_per_second=4700.0,
                                  step_seconds=0.04) for i in range(4)}
    _candidates_or_none(core)
    report_load(core, "e0", tokens["e0"], prefill_tokens_per_second=float("nan"), step_seconds=0.04)
    _candidates_or_none(core)
    model = core.fleet._index._models[MODEL]
    assert model.orders["ready"][-1][2] == "e0"
    assert all(key == key for keys in model.keys.values() for key in keys.values()), "no NaN key: it breaks bisect"
    report_load(core, "e0", tokens["e0"], queued_tokens=5, prefill_tokens_per_second=4700.0, step_seconds=0.04)
    _candidates_or_none(core)
    _assert_keys_current(core)


@pytest.mark.parametrize("engines", [100, 400])
def test_a_decision_looks_at_a_bounded_number_of_engines(engines: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """What one placement builds and checks does not grow with the fleet:
    no view is rebuilt (none changed since the last decision), and the
    index walks stop after K eligible engines per figure."""
    core, _ = make_core(policy="predicted_ttft")   # the default K, 8
    for i in range(engines):
        add_engine(core, f"e{i:03d}", running=i % 5, blocks_used=i % 97, cached_blocks=i % 89,
                   queued_tokens=37 * (i % 101), prefill_tokens_per_second=4700.0, step_seconds=0.04)
    _candidates_or_none(core)
    built: list[str] = []
    view_of = core.fleet._view

    def counted_view(record: Any, now: float) -> EngineView:
        built.append(record.engine_id)
        return view_of(record, now)

    monkeypatch.setattr(core.fleet, "_view", counted_view)
    checked = _count_checks(core, monkeypatch)
    assert _place(core, PlacementRequest("r", MODEL, 2032, 16, PREFIXES[0])) is not None
    assert built == []
    assert len(checked) <= 4 * 8 + 4 * 8     # four figures' K best, plus the warm ones (none here)


@pytest.mark.parametrize("few", [1, 5, 20, 40])
def test_a_few_engines_come_in_the_figures_order_sorted_apart_or_filtered(few: int) -> None:
    """fleet_index `_among`: a few engines of a large model sorted apart give
    the entries the figure's list has for them, in its order (ties included)."""
    core, _ = make_core(policy="predicted_ttft")
    for i in range(400):
        add_engine(core, f"e{i:03d}", running=i % 3, queued_tokens=100 * (i % 7), cached_blocks=i % 5,
                   prefill_tokens_per_second=4700.0, step_seconds=0.04)
    _candidates_or_none(core)
    index = core.fleet._index
    model = index._models[MODEL]
    engines = set(random.Random(few).sample(sorted(model.seq), few))
    for name in model.orders:
        expected = [entry for entry in model.orders[name] if entry[2] in engines]
        assert list(index._among(model, name, engines)) == expected


def test_a_fleet_with_every_slot_taken_is_answered_without_a_walk(monkeypatch: pytest.MonkeyPatch) -> None:
    """A busy fleet: every engine's slots taken (P0's reserved one free). A
    request looks only among the engines with a slot free for its class, so
    a failed attempt reads no engine at all -- it walked all of them, ~3 ms
    per attempt at 1,024 engines -- and a P0 still finds the reserved slot."""
    core, _ = make_core(policy="predicted_ttft", placement_candidates=2, engine_queue_slack=0,
                        p0_reserved_leases=1)
    for i in range(40):
        add_engine(core, f"e{i}", max_running=2)
    for n in range(40):   # one lease each: the unreserved slot of every engine taken
        core.handle(RequestArrived(opts(f"r{n}", priority=1)))
    asked = _count_checks(core, monkeypatch)
    assert _candidates(core, PlacementRequest("p1", MODEL, 32, 16, priority=1)) == set()
    assert asked == []
    assert len(_candidates(core, PlacementRequest("p0", MODEL, 32, 16, priority=0))) > 0


def _count_checks(core: SchedulerCore, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """From now on, every engine a decision checks (`eligible`), in order."""
    checked: list[str] = []
    eligibility = core.fleet._eligibility

    def counted_eligibility(*args: Any) -> Callable[[str], bool]:
        eligible = eligibility(*args)

        def counted_check(engine_id: str) -> bool:
            checked.append(engine_id)
            return eligible(engine_id)
        return counted_check

    monkeypatch.setattr(core.fleet, "_eligibility", counted_eligibility)
    return checked
