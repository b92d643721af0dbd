"""The engine's measured step speed (services/engine/step_speed.py): what the
load report's fields 310-312 carry, from the sim's steps and vLLM's stats."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator
from types import SimpleNamespace

import pytest
from engine_helpers import engine_config, mesh_config

from services.common.config import SimCostConfig
from services.engine.backend import GenerationRequest, Sampling
from services.engine.sim.backend import SimBackend
from services.engine.sim.cost_model import StepWork, step_seconds
from services.engine.step_speed import StepSpeed
from services.engine.vllm_backend.stats import EngineStats, forward_iteration

# The calibrated Llama-3-8B / A100 profile at the benchmark's speed_factor 4.
CALIBRATED_X4 = SimCostConfig(decode_seconds_per_step=0.0097758, decode_seconds_per_sequence=0.0000294,
                              prefill_seconds_per_token=0.0000529, decode_seconds_per_kilotoken_context=0.000087,
                              speed_factor=4.0)


@contextlib.asynccontextmanager
async def real_speed_sim() -> AsyncIterator[SimBackend]:
    """A started sim at speed_factor 1 (its steps take real time to measure)."""
    engine = engine_config()
    engine.sim.speed_factor = 1.0
    backend = SimBackend(mesh_config(), engine)
    await backend.start()
    try:
        yield backend
    finally:
        await backend.stop()


async def drain(backend: SimBackend, rid: str, prompt_tokens: int, max_tokens: int) -> None:
    request = GenerationRequest(rid, backend.codec.clean_token_ids[:1] * prompt_tokens, Sampling(max_tokens=max_tokens))
    async for _ in backend.generate(request):
        pass


def test_fit_recovers_the_cost_models_prefill_speed_and_step_time() -> None:
    """Steps as the calibrated sim at speed_factor 4 takes them, mostly short
    tails with some full chunks, timer noise of a few ms: the slope is the
    marginal prefill speed (~4,700 tok/s), the intercept a step without prefill."""
    rng = random.Random(1)
    speed = StepSpeed()
    assert speed.prefill_tokens_per_second == 0.0 and speed.step_seconds == 0.0   # unknown
    for _ in range(400):
        prefill = rng.choice([0, 0, 0, 30, 30, 60, 512])
        work = StepWork(prefill_tokens=prefill, decode_sequences=8, decode_context_tokens=8 * 2000)
        speed.observe(step_seconds(CALIBRATED_X4, work) + rng.uniform(0, 0.004), prefill)
    assert speed.prefill_tokens_per_second == pytest.approx(1 / (4 * 0.0000529), rel=0.1)
    base = step_seconds(CALIBRATED_X4, StepWork(decode_sequences=8, decode_context_tokens=16000))
    assert speed.step_seconds == pytest.approx(base + 0.002, rel=0.1)


def test_steps_all_alike_keep_the_last_good_slope() -> None:
    speed = StepSpeed()
    for i in range(100):
        speed.observe(0.04 + 0.0002 * (512 if i % 2 else 0), 512 if i % 2 else 0)
    measured = speed.prefill_tokens_per_second
    assert measured == pytest.approx(5000, rel=0.01)
    for _ in range(500):                     # pure decode, then an unmeasured step
        speed.observe(0.04, 0)
    speed.observe(None, 300)
    assert speed.prefill_tokens_per_second == pytest.approx(measured, rel=1e-6)
    assert speed.step_seconds == pytest.approx(0.04, rel=1e-6)


def test_vllm_stats_feed_the_speed_without_an_observer() -> None:
    stats = EngineStats()
    details = SimpleNamespace(iteration_details=None)
    for i in range(60):
        prefill = 400 if i % 3 == 0 else 0
        elapsed = SimpleNamespace(iteration_details=SimpleNamespace(elapsed_ms=20.0 + prefill * 0.1))
        it = SimpleNamespace(iteration_timestamp=float(i), prompt_token_stats=SimpleNamespace(computed=prefill),
                             num_generation_tokens=4, num_preempted_reqs=0, inter_token_latencies_iter=[],
                             finished_requests=[])
        forward_iteration(stats, elapsed if i else details, it, busy_before=bool(i))
    assert stats.speed.prefill_tokens_per_second == pytest.approx(10000, rel=0.01)
    assert stats.speed.step_seconds == pytest.approx(0.02, rel=0.01)


def test_the_sim_reports_what_its_steps_measured() -> None:
    async def run() -> None:
        async with real_speed_sim() as backend:
            assert backend.load().prefill_tokens_per_second == 0.0
            assert backend.load().step_token_budget == engine_config().sim.chunk_tokens
            for i, n in enumerate((40, 700, 200, 900)):
                await drain(backend, f"r{i}", n, 3)
            load = backend.load()
            assert load.prefill_tokens_per_second > 0 and load.step_seconds > 0

    asyncio.run(run())


def test_fit_separates_the_decode_load_and_reports_the_batch_now() -> None:
    """Steps at batches of 1-8 with some prefill, as the sim's cost model
    takes them: the fit finds what one more sequence adds to a step, so an
    engine that went idle reports the fixed cost, not its last busy batch's
    step time (which a burst read as 'slower' and avoided)."""
    rng = random.Random(2)
    speed = StepSpeed()
    for i in range(600):
        batch = 1 + (i // 40) % 8         # the batch drifts as requests come and go
        prefill = rng.choice([0, 0, 30, 512])
        work = StepWork(prefill_tokens=prefill, decode_sequences=batch, decode_context_tokens=batch * 3000)
        speed.observe(step_seconds(CALIBRATED_X4, work) + rng.uniform(0, 0.001), prefill, batch)
    per_sequence = 4 * (0.0000294 + 3 * 0.000087)
    assert speed.seconds_per_sequence == pytest.approx(per_sequence, rel=0.15)
    assert speed.prefill_tokens_per_second == pytest.approx(1 / (4 * 0.0000529), rel=0.1)
    assert speed.step_seconds_at(0) == pytest.approx(4 * 0.0097758 + 0.0005, rel=0.1)
    assert speed.step_seconds_at(8) - speed.step_seconds_at(0) == pytest.approx(8 * per_sequence, rel=0.15)
    # then only one batch size for a long while: the decode slope is kept
    for _ in range(500):
        speed.observe(step_seconds(CALIBRATED_X4, StepWork(decode_sequences=4, decode_context_tokens=12000)), 0, 4)
    assert speed.seconds_per_sequence == pytest.approx(per_sequence, rel=0.15)


def test_an_idle_sim_reports_its_fixed_step_not_its_last_batch() -> None:
    async def run() -> None:
        async with real_speed_sim() as backend:
            # batches of 1 to 8 (staggered prompt lengths), then idle
            for round_ in range(3):
                await asyncio.gather(*(drain(backend, f"r{round_ * 10 + i}", 50 + 60 * i, 40) for i in range(8)))
            idle = backend.load()
            assert idle.running == 0
            assert backend._speed.seconds_per_sequence > 0
            assert idle.step_seconds == pytest.approx(backend._speed.step_seconds_at(0))
            assert idle.step_seconds < backend._speed.step_seconds_at(8)

    asyncio.run(run())
