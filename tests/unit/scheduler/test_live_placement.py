"""`predicted_ttft`'s eviction charge: cold placement charged the live blocks it would
evict, and the live working set behind it (fake views, fake clock)."""

from __future__ import annotations

import random

import pytest

from services.common.config import SchedulerConfig
from services.scheduler.placement import PickerState, PlacementRequest, ScoredEngine, build_policy, builtin_registry
from services.scheduler.placement.live import LiveWorkingSet
from services.scheduler.placement.predicted import PredictedTtftPicker, eviction_seconds

from .test_predicted_ttft import FALLBACK, REQUEST, view


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def pick(picker: PredictedTtftPicker, views: list, seed: int = 0) -> str:
    order = list(views)
    random.Random(seed).shuffle(order)
    chosen = picker.pick(REQUEST, [ScoredEngine(v, 0.5) for v in order], PickerState(rng=random.Random(0)))
    assert chosen is not None
    return chosen.engine_id


def test_eviction_counts_only_live_blocks_over_the_room() -> None:
    # 640 blocks, 300 live: 130 new blocks fit beside them, nothing live evicted
    assert eviction_seconds(view("a", live_blocks=300, blocks_needed=130), FALLBACK) == 0.0
    # 600 live + 130 needed: 90 live blocks of 16 tokens pushed out, re-prefilled at 4,700 tok/s
    assert eviction_seconds(view("a", live_blocks=600, blocks_needed=130), FALLBACK) == pytest.approx(
        90 * 16 / 4700)
    # at most the live blocks themselves
    assert eviction_seconds(view("a", live_blocks=20, blocks_needed=700), FALLBACK) == pytest.approx(
        20 * 16 / 4700)


def test_cold_request_goes_where_it_evicts_no_live_session() -> None:
    # Equal predicted TTFT (both cold, idle); "full" holds 600 live blocks, "roomy" 100.
    views = [view("full", live_blocks=600, blocks_needed=130), view("roomy", live_blocks=100, blocks_needed=130)]
    live = PredictedTtftPicker(FALLBACK, 0.1, evict_weight=1.0)
    assert {pick(live, views, seed=s) for s in range(10)} == {"roomy"}
    # the plain picker cannot tell them apart: the candidates' order decides
    plain = PredictedTtftPicker(FALLBACK, 0.1)
    assert {pick(plain, views, seed=s) for s in range(10)} == {"full", "roomy"}
    # a busier roomy engine still wins while its queue costs less than the evicted prefill (0.31 s)
    busier = [views[0], view("roomy", live_blocks=100, blocks_needed=130, queued_tokens=700)]
    assert {pick(live, busier, seed=s) for s in range(10)} == {"roomy"}
    swamped = [views[0], view("roomy", live_blocks=100, blocks_needed=130, queued_tokens=4000)]
    assert {pick(live, swamped, seed=s) for s in range(10)} == {"full"}


def test_a_warm_engine_is_still_preferred() -> None:
    from .test_predicted_ttft import warm
    views = [view("roomy", live_blocks=0, blocks_needed=130), warm("w", live_blocks=640, blocks_needed=2)]
    assert pick(PredictedTtftPicker(FALLBACK, 0.1, evict_weight=1.0), views) == "w"


def test_live_set_counts_distinct_recent_hashes_and_ages_out() -> None:
    clock = Clock()
    live = LiveWorkingSet(4.0, capacity=1000, clock=clock)
    live.add(range(100), "a")
    clock.now += 2.0
    live.add(range(50, 150), "a")         # overlaps: 150 distinct
    live.add(range(10), "b")
    assert live.live_hashes(["a", "b", "c"]) == {"a": 150, "b": 10, "c": 0}
    clock.now += 2.5                      # the first placement's own hashes (0..49) aged out
    assert live.live_hashes(["a", "b"]) == {"a": 100, "b": 10}
    clock.now += 2.0                      # all of them aged out
    assert live.live_hashes(["a", "b"]) == {"a": 0, "b": 0}
    live.forget_engine("a")
    assert live.live_hashes(["a"]) == {"a": 0}


def test_live_set_is_bounded() -> None:
    clock = Clock()
    live = LiveWorkingSet(60.0, capacity=100, clock=clock)
    live.add(range(80), "a")
    clock.now += 1
    live.add(range(1000, 1080), "b")      # over capacity: a's oldest go first
    counts = live.live_hashes(["a", "b"])
    assert counts == {"a": 20, "b": 80}
    with pytest.raises(ValueError):
        LiveWorkingSet(0.0, 10)


def test_the_policy_fills_live_blocks_from_its_own_placements() -> None:
    config = SchedulerConfig(policy="predicted_ttft")
    policy = build_policy("predicted_ttft", config, builtin_registry(config))
    assert policy.live is not None
    engines = [view("a", prefill_tokens_per_second=0.0), view("b", prefill_tokens_per_second=0.0)]
    first = policy.place(REQUEST, engines, _Nothing(), 16, 0)
    assert first is not None
    views = policy.complete_views(PlacementRequest("s", "m", 100, 8, prefix_hashes=(9,)), engines, _Nothing(), 16, 0)
    by_id = {v.engine_id: v.live_blocks for v in views}
    assert by_id[first.view.engine_id] == len(REQUEST.prefix_hashes)
    assert sorted(by_id.values()) == [0, len(REQUEST.prefix_hashes)]
    # the plain policy tracks nothing
    plain = build_policy("predicted_ttft_plain", config, builtin_registry(config))
    assert plain.live is None


class _Nothing:
    def prefix_matches(self, prefix, engines):
        return dict.fromkeys(engines, 0)


def test_a_spread_pays_for_the_live_blocks_it_evicts() -> None:
    from .test_predicted_ttft import warm
    # the warm engine is 0.15 s behind an idle cold one (margin 0.1): the plain picker spreads...
    busy_warm = warm("w", queued_tokens=2500, live_blocks=300, blocks_needed=2)
    full_cold = view("c", live_blocks=640, blocks_needed=130)
    plain = PredictedTtftPicker(FALLBACK, 0.1)
    assert pick(plain, [busy_warm, full_cold]) == "c"
    # ...the live one stays: the spread would evict 130 live blocks (0.44 s of prefill)
    assert pick(PredictedTtftPicker(FALLBACK, 0.1, evict_weight=1.0), [busy_warm, full_cold]) == "w"
    # with room beside the cold engine's live set, it spreads as before
    roomy_cold = view("c", live_blocks=100, blocks_needed=130)
    assert pick(PredictedTtftPicker(FALLBACK, 0.1, evict_weight=1.0), [busy_warm, roomy_cold]) == "c"
