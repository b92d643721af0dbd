"""The engine's issue-17 series: what the backend reports per step and per
finished request (the sim's step loop here; vLLM's stat logger through
`forward_iteration`, fed vLLM-shaped stats), KV blocks, serving, and
generations handed over."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from engine_helpers import engine_config, engine_stub, mesh_config, prompt_of, started
from test_engine_failure import ending, open_stream
from test_grpc_service import collect, gen_request, wait_until

from services.engine.backend import RequestPhases
from services.engine.server import EngineService
from services.engine.sim.backend import SimBackend
from services.engine.vllm_backend.stats import EngineStats, forward_iteration


class Recorder:
    def __init__(self) -> None:
        self.steps: list[tuple[float | None, int, int]] = []
        self.gaps: list[float] = []
        self.phases: list[RequestPhases] = []

    def step(self, seconds: float | None, tokens: int, preempted: int) -> None:
        self.steps.append((seconds, tokens, preempted))

    def inter_token(self, seconds: float) -> None:
        self.gaps.append(seconds)

    def request_phases(self, phases: RequestPhases) -> None:
        self.phases.append(phases)


def value(svc: EngineService, name: str, **labels: str) -> float:
    base = {"model_name": svc.model_name, "engine": svc.engine.engine_id}
    return svc.metrics.registry.get_sample_value(name, {**base, **labels}) or 0.0


async def _two_that_preempt(svc: EngineService, stub: Any) -> list[tuple[list[int], str, Any]]:
    """A P0 and a P2 in one batch, with blocks for one of them to finish:
    the sim's step loop is held until both are in it."""
    backend = svc.backend
    assert isinstance(backend, SimBackend)
    backend.hang()
    calls = []
    for rid, priority, start in (("hi", 0, 300), ("lo", 2, 4000)):
        call = stub.Generate()
        await call.write(gen_request(rid, prompt_of(20, start=start), 30, priority=priority))
        calls.append(call)
    await wait_until(lambda: len(backend.load().request_ids) == 2)
    backend.resume()
    return list(await asyncio.gather(*(collect(c) for c in calls)))


async def test_sim_steps_preemptions_and_request_phases() -> None:
    """Two requests that cannot both hold their blocks: the P2 is preempted
    (vLLM's policy, as the sim models it) and both still finish."""
    svc = EngineService(mesh_config(), engine_config(total_blocks=4))
    recorder = Recorder()
    async with started(svc):
        svc.backend.set_step_observer(recorder)
        before_queue = value(svc, "vllm:request_queue_time_seconds_count")
        async with engine_stub(svc) as stub:
            results = await _two_that_preempt(svc, stub)
        assert [len(ids) for ids, _, _ in results] == [30, 30]
        assert sum(p for _, _, p in recorder.steps) >= 1
        assert all(s is not None and s >= 0 for s, _, _ in recorder.steps)
        # Every token computed, once or again after the preemption: at least prompts + outputs.
        assert sum(t for _, t, _ in recorder.steps) >= 2 * (20 + 29)
        assert len(recorder.gaps) == 2 * 29  # one per token after each request's first
        assert len(recorder.phases) == 2
        assert all(min(p.queued, p.prefill, p.decode) >= 0 for p in recorder.phases)
        # Through the real observer too (the service set its metrics; the recorder replaced them).
        svc.backend.set_step_observer(svc.metrics)
        async with engine_stub(svc) as stub:
            call = stub.Generate()
            await call.write(gen_request("after", prompt_of(20), 5))
            await collect(call)
        assert value(svc, "vllm:request_queue_time_seconds_count") == before_queue + 1
        assert value(svc, "vllm:request_prefill_time_seconds_count") == before_queue + 1
        assert value(svc, "vllm:request_decode_time_seconds_count") == before_queue + 1
        assert value(svc, "vllm:inter_token_latency_seconds_count") >= 4
        assert value(svc, "kvmesh_engine_step_seconds_count") >= 5
        assert value(svc, "vllm:iteration_tokens_total_sum") >= 20 + 4


async def test_sim_preemptions_reach_the_counter() -> None:
    svc = EngineService(mesh_config(), engine_config(total_blocks=4))
    async with started(svc), engine_stub(svc) as stub:
        await _two_that_preempt(svc, stub)
        assert value(svc, "vllm:num_preemptions_total") >= 1


async def test_kv_blocks_serving_and_handed_over() -> None:
    svc = EngineService(mesh_config(), engine_config(total_blocks=64, stop_grace_seconds=0.0))
    assert value(svc, "kvmesh_engine_serving") == 0  # loading
    async with started(svc):
        assert value(svc, "kvmesh_engine_serving") == 1
        assert value(svc, "kvmesh_engine_kv_blocks", state="total") == 64
        async with engine_stub(svc) as stub:
            call = await open_stream(stub, "long", max_tokens=900)
            assert value(svc, "kvmesh_engine_kv_blocks", state="used") >= 3  # 40 prompt tokens, 16 a block
            handed = await svc.runtime.hand_off(0.0)
            assert handed == 1
            await ending(call)
        assert value(svc, "kvmesh_engine_migrations_out_total") == 1
        assert value(svc, "kvmesh_engine_serving") == 0  # drained
        assert value(svc, "kvmesh_engine_kv_blocks", state="cached") >= 2  # the prompt's full blocks stay cached


async def test_the_hang_bound_is_exported_and_follows_the_step_intervals() -> None:
    """The gauge reads the liveness watch's bound at scrape time: the floor
    while no step interval is known, k x the p99 interval once they are long."""
    svc = EngineService(mesh_config(), engine_config())
    policy = svc.runtime.liveness.detector.policy
    assert value(svc, "kvmesh_engine_hang_bound_seconds") == policy.floor_seconds
    now = svc.runtime.clock.monotonic()
    slow = 2 * policy.floor_seconds / policy.step_multiple   # an interval giving twice the floor
    for _ in range(10):
        svc.runtime.liveness.detector.output(now, slow)
    assert value(svc, "kvmesh_engine_hang_bound_seconds") == policy.step_multiple * slow


async def test_prefix_cache_totals_for_the_load_report() -> None:
    svc = EngineService(mesh_config(), engine_config())
    async with started(svc), engine_stub(svc) as stub:
        before = svc.metrics.prefix_cache_totals()
        for rid in ("a", "b"):
            call = stub.Generate()
            await call.write(gen_request(rid, prompt_of(40), 3))
            await collect(call)
        queries, hits = svc.metrics.prefix_cache_totals()
        assert queries - before[0] == 80
        assert hits - before[1] == 32  # the second found the first's two full blocks


def _iteration(at: float, computed: int, generated: int, preempted: int = 0, gaps: tuple[float, ...] = (),
               finished: tuple[SimpleNamespace, ...] = ()) -> SimpleNamespace:
    return SimpleNamespace(iteration_timestamp=at, prompt_token_stats=SimpleNamespace(computed=computed),
                           num_generation_tokens=generated, num_preempted_reqs=preempted,
                           inter_token_latencies_iter=list(gaps), finished_requests=list(finished))


def test_vllm_iteration_stats_are_forwarded_as_vllm_reads_them() -> None:
    recorder, stats = Recorder(), EngineStats()
    stats.observer = recorder
    sched = SimpleNamespace(iteration_details=None)
    stats.running = 2  # after the first step the batch holds two requests
    forward_iteration(stats, sched, _iteration(100.0, 40, 2), busy_before=False)
    forward_iteration(stats, sched, _iteration(100.05, 0, 2, preempted=1, gaps=(0.05, 0.05)), busy_before=True)
    stats.running = 0
    done = SimpleNamespace(queued_time=0.1, prefill_time=0.2, decode_time=0.3)
    forward_iteration(stats, sched, _iteration(100.08, 0, 1, finished=(done,)), busy_before=True)
    # A step after an idle engine has no known duration; then steps are timestamp gaps.
    first, second, third = (s for s, _, _ in recorder.steps)
    assert first is None
    assert second is not None and abs(second - 0.05) < 1e-9
    assert third is not None and abs(third - 0.03) < 1e-9
    assert [(t, p) for _, t, p in recorder.steps] == [(42, 0), (2, 1), (1, 0)]
    assert recorder.gaps == [0.05, 0.05]
    assert recorder.phases == [RequestPhases(0.1, 0.2, 0.3)]
    # The next step after the batch emptied has no duration either.
    stats.running = 1
    forward_iteration(stats, sched, _iteration(200.0, 10, 1), busy_before=False)
    assert recorder.steps[-1][0] is None
    # With vLLM's iteration details, their elapsed time is the step's.
    forward_iteration(stats, SimpleNamespace(iteration_details=SimpleNamespace(elapsed_ms=12.5)),
                      _iteration(200.5, 0, 1), busy_before=True)
    assert recorder.steps[-1][0] == 0.0125
