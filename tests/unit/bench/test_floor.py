"""The floor: a run's requests replayed through the sim's cost model on an ideal fleet."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.bench.floor import FloorRequest, floor_summary, prompt_ids, replay
from services.bench.stats import RequestResult, summarize
from services.common.config import EngineConfig, SimCostConfig
from services.common.tokenizer import HfTokenizer
from services.engine.sim.cost_model import StepWork, step_seconds

ROOT = Path(__file__).resolve().parents[3]
TOKENIZER = ROOT / ".models" / "tiny-llama"
COST = SimCostConfig(prefill_seconds_per_token=0.0001, decode_seconds_per_step=0.01,
                     decode_seconds_per_sequence=0.001, decode_seconds_per_kilotoken_context=0.002,
                     chunk_tokens=512, speed_factor=2.0)


def _engine(max_running: int = 64) -> EngineConfig:
    return EngineConfig(block_size=16, total_blocks=64, max_running=max_running, sim=COST)


def _prompt(n: int, seed: int = 0) -> tuple[int, ...]:
    return tuple((seed * 7919 + i) % 30000 for i in range(n))


def test_an_idle_request_takes_the_cost_models_prefill_steps_then_its_decode_steps() -> None:
    [out] = replay([FloorRequest(1.5, _prompt(1000), output_tokens=3)], _engine(), engines=2)
    prefill = step_seconds(COST, StepWork(prefill_tokens=512)) + step_seconds(COST, StepWork(prefill_tokens=488))
    assert out.ttft == pytest.approx(prefill)
    decode = sum(step_seconds(COST, StepWork(0, 1, 1000 + k + 1)) for k in range(2))
    assert out.e2e == pytest.approx(prefill + decode) and out.cached_tokens == 0


def test_a_repeated_prompt_is_cached_on_every_engine_up_to_its_last_full_block() -> None:
    first, again, other = replay([FloorRequest(0.0, _prompt(1000), 1), FloorRequest(5.0, _prompt(1000), 1),
                                  FloorRequest(5.0, _prompt(1000), 1)], _engine(), engines=2)
    assert first.cached_tokens == 0 and again.cached_tokens == other.cached_tokens == 992  # 62 blocks of 16
    assert again.engine != other.engine  # both idle engines serve it at once: the cache is fleet-wide
    assert again.ttft == pytest.approx(step_seconds(COST, StepWork(prefill_tokens=8)))
    # Warm prompts are cached from the start.
    [warm] = replay([FloorRequest(0.0, _prompt(1000), 1)], _engine(), engines=1, warm=[_prompt(1000)])
    assert warm.cached_tokens == 992


def test_overload_queues_behind_the_chunk_budget_and_spreads_over_engines() -> None:
    burst = [FloorRequest(0.0, _prompt(512, seed=k), 1) for k in range(6)]
    one = replay(burst, _engine(), engines=1)
    step = step_seconds(COST, StepWork(prefill_tokens=512))
    # One 512-token prefill per step: the k-th first token comes after k + 1 steps (plus decodes riding along).
    ttfts = [o.ttft for o in one]
    assert ttfts == sorted(ttfts) and ttfts[0] == pytest.approx(step) and ttfts[-1] >= 6 * step
    three = replay(burst, _engine(), engines=3)
    assert sorted(o.engine for o in three) == [0, 0, 1, 1, 2, 2]
    assert max(o.ttft or 0.0 for o in three) < ttfts[-1] / 2
    # The batch cap holds a request back until a slot frees.
    capped = replay([FloorRequest(0.0, _prompt(32, seed=k), 5) for k in range(2)], _engine(max_running=1), 1)
    assert (capped[1].ttft or 0.0) > (capped[0].e2e or 0.0)


def test_prompt_ids_are_the_gateways_chat_prompt_ids() -> None:
    tok = HfTokenizer(TOKENIZER)
    ids = prompt_ids(TOKENIZER)
    context = "Group 1 reference document. " + "the contract clause " * 200
    chats = [[{"role": "system", "content": context}, {"role": "user", "content": f"Question {k}?"}]
             for k in range(12)]
    chats.append([*chats[0], {"role": "assistant", "content": " an answer"}, {"role": "user", "content": "more?"}])
    assert all(list(ids(c)) == tok.chat_prompt(c).token_ids for c in chats)


def test_floor_summary_has_the_overall_shape_and_replays_the_run() -> None:
    context = "Group 0 reference document. " + "river mountain ledger " * 300
    results = []
    for conv in range(4):
        messages = [{"role": "system", "content": context}, {"role": "user", "content": f"Question {conv}?"}]
        results.append(RequestResult(conv, 0, None, 0, status=200, ok=True, start=2.0 * conv, ttft=0.5, e2e=0.6,
                                     completion_tokens=4, max_tokens=4, messages=messages))
    results.append(RequestResult(9, 0, None, 0, start=1.0))  # nothing sent: no chat, not replayed
    floor = floor_summary(results, _engine(), 2, TOKENIZER)
    assert set(summarize(results, 8.0)["overall"]) <= set(floor)
    assert floor["requests"] == floor["ok"] == 4 and sum(floor["per_engine"]) == 4
    prompt = len(HfTokenizer(TOKENIZER).chat_prompt(results[0].messages).token_ids)
    assert floor["prompt_tokens"] > 4 * (prompt - 5) and floor["completion_tokens"] == 16
    # The first request computes the context; the other three hit it.
    assert 0.7 < floor["prefix_hit_rate"] < 0.75
    assert floor["ttft_s"]["max"] > 3 * floor["ttft_s"]["p50"]
    assert floor["requests_per_s"] == pytest.approx(4 / (6.0 + floor["e2e_s"]["p50"]), rel=0.05)


def _sim_core_ttfts(requests: list[FloorRequest], engine: EngineConfig) -> list[float]:
    """The same requests through the sim's own step loop (sim/core.py) in virtual time, one engine."""
    from services.engine.backend import GenerationRequest, Sampling
    from services.engine.model import SyntheticCodec
    from services.engine.sim.core import CoreLimits, SimCore
    from services.engine.sim.text import TokenPicker

    codec = SyntheticCodec(32000)
    core = SimCore(CoreLimits(engine.block_size, engine.total_blocks, engine.max_running, 16, COST.chunk_tokens),
                   TokenPicker(codec.clean_token_ids, codec.eos_token_id, 0.0), codec.token_text,
                   codec.eos_token_id)
    pending, live, ttft, now = list(enumerate(requests)), {}, {}, 0.0
    while pending or core.has_work():
        while pending and pending[0][1].start <= now:
            i, r = pending.pop(0)
            live[i] = core.add(GenerationRequest(str(i), list(r.prompt), Sampling(max_tokens=r.output_tokens,
                                                                                   ignore_eos=True)))
        if not core.has_work():
            now = pending[0][1].start
            continue
        plan = core.schedule()
        now += step_seconds(COST, plan.work)
        core.apply(plan)
        ttft.update({i: now - requests[i].start for i, s in live.items() if s.generated and i not in ttft})
    return [ttft[i] for i in range(len(requests))]


def test_on_one_engine_with_room_the_replay_is_the_sims_own_step_loop() -> None:
    # Shared prefixes, a batch cap of 3 and bursts past one engine's chunk budget: every case of the step loop.
    base = _prompt(700, seed=1)
    requests = [FloorRequest(0.05 * k, base[: 300 + 37 * (k % 5)] + _prompt(40 + 13 * k, seed=k), 2 + k % 4)
                for k in range(24)]
    requests[7::8] = [FloorRequest(r.start, base[:320], 2) for r in requests[7::8]]  # exact repeats, whole blocks
    engine = EngineConfig(block_size=16, total_blocks=100_000, max_running=3, sim=COST)
    floor = [o.ttft for o in replay(requests, engine, engines=1)]
    assert floor == pytest.approx(_sim_core_ttfts(requests, engine), abs=1e-9)
    assert max(t or 0.0 for t in floor) > 5 * min(t or 0.0 for t in floor)  # it did queue


def test_the_fleets_kv_pooled_keeps_what_is_used_next_and_with_room_is_the_unbounded_floor() -> None:
    a, b, c = _prompt(320, seed=1), _prompt(320, seed=2), _prompt(320, seed=3)  # 20 blocks each
    requests = [FloorRequest(t, p, 3) for t, p in ((0.0, a), (5.0, b), (10.0, c), (15.0, a))]
    # Room for one prompt idle and one running (+ their partial blocks): when C runs, B's blocks
    # (never used again) go, not A's (used next) -- least-recently-used would have dropped A's.
    pooled = replay(requests, _engine(), engines=1, kv_blocks=45)
    assert pooled[3].cached_tokens == 304
    # Room for the running one only: A's chain loses its tail first, so what is left still hits.
    tight = replay(requests, _engine(), engines=1, kv_blocks=30)
    assert 0 < tight[3].cached_tokens < 304
    base = _prompt(700, seed=1)
    mixed = [FloorRequest(0.05 * k, base[: 300 + 37 * (k % 5)] + _prompt(40 + 13 * k, seed=k), 2 + k % 4)
             for k in range(24)]
    roomy = replay(mixed, _engine(max_running=3), engines=2, kv_blocks=100_000)
    assert [o.ttft for o in roomy] == [o.ttft for o in replay(mixed, _engine(max_running=3), engines=2)]
