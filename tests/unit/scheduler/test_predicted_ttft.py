"""The `predicted_ttft` policy: the prediction, spreading a hot prefix and
shrinking back, and the in-flight prefix overlay (fake views, fake clocks)."""

from __future__ import annotations

import dataclasses
import random

import pytest

from services.common.config import SchedulerConfig
from services.scheduler.placement import (
    EngineView,
    PickerState,
    PlacementRequest,
    ScoredEngine,
    build_policy,
    builtin_registry,
)
from services.scheduler.placement.inflight import InflightPrefixes, OverlaidPrefixes
from services.scheduler.placement.predicted import PredictedTtftPicker, predicted_ttft, with_peer_speed

from .helpers import add_engine, admit, engine_view, make_core, opts, report_load

FALLBACK = 20000.0
PREFIX = tuple(range(100, 225))            # 125 blocks of 16 tokens: a 2,000-token context
REQUEST = PlacementRequest("r", "m", prompt_tokens=2030, max_tokens=16, prefix_hashes=PREFIX)


def view(engine_id: str, **kw: object) -> EngineView:
    fields: dict[str, object] = dict(blocks_total=640, prefill_tokens_per_second=4700.0, step_seconds=0.04,
                                     step_token_budget=512)
    return engine_view(engine_id, **{**fields, **kw})


def warm(engine_id: str, **kw: object) -> EngineView:
    return view(engine_id, prefix_blocks=len(PREFIX), cached_tokens=2000, **kw)


def pick(views: list[EngineView], margin: float = 0.1, seed: int = 0) -> str:
    """The picker's choice, candidates in a seeded random order (as the framework's ties)."""
    order = list(views)
    random.Random(seed).shuffle(order)
    chosen = PredictedTtftPicker(FALLBACK, margin).pick(
        REQUEST, [ScoredEngine(v, 0.5) for v in order], PickerState(rng=random.Random(0)))
    assert chosen is not None
    return chosen.engine_id


def test_prediction_counts_work_ahead_uncached_prompt_and_steps() -> None:
    cold = predicted_ttft(REQUEST, view("c"), FALLBACK)
    # 2,030 uncached tokens at 4,700 tok/s + (1 + 2030 // 512 = 4... = 4 steps) x 40 ms
    assert cold == pytest.approx(2030 / 4700 + 4 * 0.04)
    hot = predicted_ttft(REQUEST, warm("w"), FALLBACK)
    assert hot == pytest.approx(30 / 4700 + 0.04)
    busy = predicted_ttft(REQUEST, warm("w", queued_tokens=4000, unreported_tokens=1000), FALLBACK)
    assert busy == pytest.approx(5030 / 4700 + (1 + 5030 // 512) * 0.04)
    # slot wait: what the fleet's queue_seconds holds beyond queued tokens at the fixed rate
    slots = predicted_ttft(REQUEST, warm("w", queued_tokens=2000, queue_seconds=2000 / FALLBACK + 0.7), FALLBACK)
    assert slots == pytest.approx(0.7 + 2030 / 4700 + (1 + 2030 // 512) * 0.04)
    # unmeasured: the fixed rate x weight, no step term
    unknown = predicted_ttft(REQUEST, view("u", prefill_tokens_per_second=0.0, step_seconds=0.0, weight=2.0),
                             FALLBACK)
    assert unknown == pytest.approx(2030 / (2 * FALLBACK))


def test_a_warm_engine_wins_over_idle_cold_ones() -> None:
    views = [view("a"), view("b"), warm("w", queued_tokens=600, running=6), view("c")]
    assert {pick(views, seed=s) for s in range(10)} == {"w"}


def test_measured_speed_decides_between_cold_engines() -> None:
    views = [view("slow", prefill_tokens_per_second=1500.0), view("fast", prefill_tokens_per_second=6000.0)]
    assert {pick(views, seed=s) for s in range(10)} == {"fast"}


def test_a_saturated_warm_engine_spills_to_a_cold_one() -> None:
    # 20,000 prompt tokens queued on the warm engine: ~4.3 s against a cold prefill of ~0.6 s
    views = [warm("w", queued_tokens=20000, running=8, waiting=6), view("a", running=1), view("b", running=1)]
    assert pick(views) in ("a", "b")
    # within the margin the warm engine keeps it
    # (no step term: warm = (queued + 30) / 4700 s, cold = 2030 / 4700 s; 2235 queued = cold + 50 ms)
    views = [warm("w", queued_tokens=2235, step_seconds=0.0), view("a", step_seconds=0.0)]
    assert pick(views, margin=0.1) == "w"
    assert pick(views, margin=0.0) == "a"


def test_spreading_shrinks_back_to_one_preferred_copy() -> None:
    """Two warm copies: under load on the preferred one the other takes the
    overflow; when load falls, every request goes to the same copy whatever
    the candidates' order, so the other ages out."""
    idle = [warm("w1"), warm("w2"), view("c")]
    preferred = {pick(idle, seed=s) for s in range(20)}
    assert len(preferred) == 1
    first = preferred.pop()
    other = "w2" if first == "w1" else "w1"
    busy = [warm(first, queued_tokens=3000), warm(other), view("c")]
    assert {pick(busy, seed=s) for s in range(20)} == {other}
    # a little noise below the margin does not move it
    noisy = [warm(first, queued_tokens=200), warm(other), view("c")]
    assert {pick(noisy, seed=s) for s in range(20)} == {first}


def test_inflight_overlay_extends_matches_until_reported_or_expired() -> None:
    now = [0.0]
    inflight = InflightPrefixes(5.0, 1000, clock=lambda: now[0])
    reported: dict[str, dict[int, bool]] = {"a": {}, "b": {}}

    class Kv:
        def prefix_matches(self, prefix, engines):
            out = {}
            for e in engines:
                n = 0
                while n < len(prefix) and reported[e].get(prefix[n]):
                    n += 1
                out[e] = n
            return out

    source = OverlaidPrefixes(Kv(), inflight)
    inflight.add((1, 2, 3), "a")
    assert source.prefix_matches((1, 2, 3, 4), ["a", "b"]) == {"a": 3, "b": 0}
    # the engine reports the blocks: the overlay drops them; an eviction then shows
    reported["a"] = {1: True, 2: True, 3: True}
    assert source.prefix_matches((1, 2, 3), ["a", "b"]) == {"a": 3, "b": 0}
    reported["a"] = {}
    assert source.prefix_matches((1, 2, 3), ["a", "b"]) == {"a": 0, "b": 0}
    # never reported: gone after the TTL
    inflight.add((7, 8), "b")
    now[0] = 4.9
    assert source.prefix_matches((7, 8), ["a", "b"])["b"] == 2
    now[0] = 5.1
    assert source.prefix_matches((7, 8), ["a", "b"])["b"] == 0
    inflight.add((9,), "a")                 # pruning on add drops the expired entries
    assert len(inflight) == 1
    inflight.forget_engine("a")
    assert source.prefix_matches((9,), ["a"]) == {"a": 0}


class _NoKv:
    def prefix_matches(self, prefix, engines):
        return dict.fromkeys(engines, 0)


@pytest.mark.parametrize(("policy", "engines_used"), [("predicted_ttft", 1), ("kv_precise", 4)])
def test_a_burst_of_one_new_prefix_lands_on_one_engine(policy: str, engines_used: int) -> None:
    """No KV event yet: with the overlay the first placement makes its
    engine warm for the rest of the burst; kv_precise spreads the copies."""
    config = SchedulerConfig(policy=policy)
    chosen = build_policy(policy, config, builtin_registry(config))
    views = [view(e) for e in "abcd"]
    used = []
    for i in range(4):
        request = dataclasses.replace(REQUEST, request_id=f"r{i}")
        placement = chosen.place(request, views, _NoKv(), 16, 256)
        assert placement is not None
        used.append(placement.view.engine_id)
        # each placement shows as a lease (no report yet): the load scorer sees it
        views = [dataclasses.replace(v, leases=v.leases + 1) if v.engine_id == used[-1] else v for v in views]
    assert len(set(used)) == engines_used


def test_an_unmeasured_engine_borrows_its_peers_speed() -> None:
    fresh = view("fresh", prefill_tokens_per_second=0.0, step_seconds=0.0, weight=2.0)
    peers = [view("a", prefill_tokens_per_second=4000.0, step_seconds=0.06),
             view("b", prefill_tokens_per_second=5000.0, step_seconds=0.04),
             view("c", prefill_tokens_per_second=9000.0, step_seconds=0.09)]
    got = {v.engine_id: v for v in with_peer_speed([fresh, *peers])}
    # the median speed, the fastest step, per unit of weight
    assert (got["fresh"].prefill_tokens_per_second, got["fresh"].step_seconds) == (2 * 5000.0, 0.04 / 2)
    assert [got[p.engine_id] for p in peers] == peers
    # nothing measured anywhere: the fixed fallback stays in charge
    alone = [view("x", prefill_tokens_per_second=0.0, step_seconds=0.0)]
    assert with_peer_speed(alone) == alone


def test_a_burst_after_an_engine_restart_spreads_over_both_engines() -> None:
    """The restarted engine has measured nothing yet. Predicted on the fixed
    20,000 tok/s and no step term, it was ~50 ms faster than its measured
    idle peer for a short prompt, and a whole burst of new streams went
    there (and stayed on the next turn: its prefixes were warm)."""
    config = SchedulerConfig(policy="predicted_ttft")
    chosen = build_policy("predicted_ttft", config, builtin_registry(config))
    short = dataclasses.replace(REQUEST, prompt_tokens=20, prefix_hashes=(7,))
    views = [view("measured", prefill_tokens_per_second=1500.0, step_seconds=0.05),
             view("restarted", prefill_tokens_per_second=0.0, step_seconds=0.0)]
    used = []
    for i in range(6):
        request = dataclasses.replace(short, request_id=f"r{i}", prefix_hashes=(1000 + i,))
        placement = chosen.place(request, views, _NoKv(), 16, 256)
        assert placement is not None
        used.append(placement.view.engine_id)
        own = next(v for v in views if v.engine_id == used[-1])  # its own speed, not the borrowed one
        assert placement.view.prefill_tokens_per_second == own.prefill_tokens_per_second
        views = [dataclasses.replace(v, leases=v.leases + 1, unreported_tokens=v.unreported_tokens + 20)
                 if v.engine_id == used[-1] else v for v in views]
    assert used.count("measured") == used.count("restarted") == 3


def test_measured_speed_and_unreported_leases_reach_the_view() -> None:
    core, _ = make_core(policy="predicted_ttft")
    token = add_engine(core, "e1", prefill_tokens_per_second=4700.0, step_seconds=0.04, step_token_budget=512)
    admit(core, opts("r1", prompt_tokens=1000, max_tokens=16))
    [v] = core.fleet.views("m", 1000.0)
    assert (v.prefill_tokens_per_second, v.step_seconds, v.step_token_budget) == (4700.0, 0.04, 512)
    assert v.leases == 1 and v.unreported_tokens == 1000
    report_load(core, "e1", token, request_ids=["r1"], queued_tokens=1000, prefill_tokens_per_second=4700.0)
    [v] = core.fleet.views("m", 1000.0)
    assert v.unreported_tokens == 0 and v.queued_tokens == 1000
