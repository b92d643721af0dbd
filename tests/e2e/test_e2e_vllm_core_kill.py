"""A dead engine is dead: SIGKILL of one vLLM engine's `VLLM::EngineCore`
process (what a GPU fault, an OOM kill or a crashed kernel looks like) while
greedy streams run, its engine service still alive.

Every stream completes with text identical to an uninterrupted greedy run
(the engine ends its streams UNAVAILABLE and the gateway migrates them, no
`finish_reason: error`); the scheduler stops placing on the dead engine
(new requests meanwhile all run on the other one); the engine process exits
with code 3 and the launcher's supervision loop -- the one `kvmesh up`
runs -- restarts it with the same id and port, and it serves again (the
same greedy tokens as the surviving engine).

ONE test, its own mesh: two vLLM engines start in ~1-2 minutes on 2 cores,
the restarted one again.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from _streams import StreamResult, gateway_counter, run_streams, scheduler_state, wait_until
from _vllm_mesh import running_vllm_mesh

from services.common.affinity import vllm_processes
from services.common.config import MeshConfig
from services.common.proto.kvmesh.v1 import common_pb2, engine_pb2, engine_pb2_grpc, scheduler_pb2
from services.common.service_main import EXIT_SERVICE_FAILED
from services.launcher.mesh import Mesh
from services.launcher.up import Restarts

pytestmark = [pytest.mark.vllm, pytest.mark.e2e, pytest.mark.timeout(2400)]

STREAMS = 8
MAX_TOKENS = 1500  # ~10 s of decode: no stream ends before the kill
RESTART_SECONDS = 900.0  # a vLLM engine's start-up on a busy 2-core machine


def _tune(config: MeshConfig) -> None:
    config.engines.template.vllm.max_num_seqs = 8


@dataclass
class Supervised:
    mesh: Mesh
    restarts: Restarts


@pytest.fixture(scope="module")
def supervised(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Supervised]:
    with running_vllm_mesh(tmp_path_factory.mktemp("vllm-core-kill"), engines=2, tune=_tune) as mesh:
        stop = threading.Event()
        restarts = Restarts(mesh, stop)

        def loop() -> None:  # `kvmesh up`'s supervision loop (up.supervise), observable
            while not stop.wait(0.5):
                restarts.check()

        thread = threading.Thread(target=loop, name="supervise", daemon=True)
        thread.start()
        try:
            yield Supervised(mesh, restarts)
        finally:
            stop.set()
            thread.join(timeout=RESTART_SECONDS)


def engine_core(mesh: Mesh, engine_id: str) -> int:
    root = mesh.pid(engine_id)
    assert root is not None
    cores = [pid for pid in vllm_processes(root)
             if b"EngineCore" in Path(f"/proc/{pid}/cmdline").read_bytes()]
    assert len(cores) == 1, f"{engine_id}: vLLM processes {vllm_processes(root)}"
    return cores[0]


def engine_state(state: scheduler_pb2.SchedulerState | None, engine_id: str) -> scheduler_pb2.EngineState | None:
    return None if state is None else next((e for e in state.engines if e.engine_id == engine_id), None)


async def direct_generate(address: str, request_id: str, prompt_ids: list[int], max_tokens: int) -> list[int]:
    """One greedy generation on an engine's own gRPC port; its token ids."""
    async with grpc.aio.insecure_channel(address) as channel:
        call = engine_pb2_grpc.EngineStub(channel).Generate()
        await call.write(engine_pb2.EngineGenerateMessage(request=engine_pb2.EngineRequest(
            request_id=request_id, prompt_token_ids=prompt_ids,
            sampling=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0))))
        ids: list[int] = []
        async with asyncio.timeout(120):
            while True:
                event = await call.read()
                assert event is not grpc.aio.EOF, "the stream ended without finished"
                if event.HasField("finished"):
                    assert event.finished.finish_reason == common_pb2.FINISH_REASON_LENGTH, event.finished
                    return ids
                ids += event.delta.token_ids


async def _greedy(mesh: Mesh, prompts: list[str], max_tokens: int) -> list[StreamResult]:
    _, tasks, session = await run_streams(mesh, prompts, [max_tokens] * len(prompts))
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        await session.close()


async def test_vllm_engine_core_sigkill_migrates_every_stream_and_the_engine_restarts(
        supervised: Supervised) -> None:
    mesh, restarts = supervised.mesh, supervised.restarts
    prompts = [f"Stream {i}: the quick brown fox jumps over the lazy dog, and then" for i in range(STREAMS)]
    baseline = await _greedy(mesh, prompts, MAX_TOKENS)
    assert all(r.ok for r in baseline), [r.error for r in baseline if not r.ok]
    migrations = gateway_counter(mesh, "kvmesh_gateway_migrations_total")

    results, tasks, session = await run_streams(mesh, prompts, [MAX_TOKENS] * STREAMS)
    try:
        def spread() -> bool:
            state = scheduler_state(mesh)
            return state is not None and len(state.engines) == 2 and all(e.leases > 0 for e in state.engines)
        await wait_until(spread, 120, "both engines to hold streams")
        await wait_until(lambda: all(r.chunks >= 3 for r in results), 120, "every stream to be mid-answer")
        state = scheduler_state(mesh)
        assert state is not None
        victim = max(state.engines, key=lambda e: e.leases).engine_id
        survivor = next(e.engine_id for e in state.engines if e.engine_id != victim)
        old_pid = mesh.pid(victim)
        core = engine_core(mesh, victim)
        assert sum(r.done for r in results) < STREAMS
        killed = time.monotonic()
        os.kill(core, signal.SIGKILL)  # the engine service itself lives on
        results = list(await asyncio.gather(*tasks))
        elapsed = time.monotonic() - killed
    finally:
        await session.close()

    failed = [(i, r.status, r.finish_reason, r.error) for i, r in enumerate(results) if not r.ok]
    assert not failed, failed
    for i, (got, want) in enumerate(zip(results, baseline, strict=True)):
        assert got.text == want.text, f"stream {i}: the migrated text differs from the uninterrupted greedy run"
    moved = gateway_counter(mesh, "kvmesh_gateway_migrations_total") - migrations
    assert moved >= 1

    # Dead: the process exited 3 (the supervisor saw it), and until it is
    # back the scheduler places nothing on it.
    def exited() -> bool:
        return any(e.name == victim for e in restarts.exits)
    await wait_until(exited, 120, f"{victim}'s process to exit")
    gone = next(e for e in restarts.exits if e.name == victim)
    assert gone.returncode == EXIT_SERVICE_FAILED, f"{victim} exited {gone.returncode}; see {gone.log_path}"
    placed_on_dead: list[int] = []
    restarted_meanwhile = False
    if victim not in restarts.restarted:
        _, tasks, session = await run_streams(mesh, prompts[:4], [40] * 4)
        try:
            while not all(t.done() for t in tasks):
                view = engine_state(await asyncio.to_thread(scheduler_state, mesh), victim)
                if view is not None and view.leases:
                    placed_on_dead.append(view.leases)
                await asyncio.sleep(0.1)
            meanwhile = [t.result() for t in tasks]
        finally:
            await session.close()
        restarted_meanwhile = victim in restarts.restarted
        assert all(r.ok for r in meanwhile), [r.error for r in meanwhile if not r.ok]
        assert restarted_meanwhile or not placed_on_dead, placed_on_dead

    # Back: restarted by the supervision loop (same id, same port), serving.
    def back() -> bool:
        view = engine_state(scheduler_state(mesh), victim)
        return victim in restarts.restarted and view is not None and view.serving and view.fresh
    await wait_until(back, RESTART_SECONDS, f"{victim} to be restarted and serving", poll=1.0)
    assert mesh.pid(victim) != old_pid
    back_after = time.monotonic() - killed

    # It serves again: straight to its gRPC port, the same greedy tokens as the survivor's.
    state = scheduler_state(mesh)
    addresses = {e.engine_id: e.address for e in state.engines} if state is not None else {}
    prompt_ids = [100 + (i * 37) % 5000 for i in range(48)]
    again = await direct_generate(addresses[victim], "after-restart-victim", prompt_ids, 64)
    assert len(again) == 64
    assert again == await direct_generate(addresses[survivor], "after-restart-survivor", prompt_ids, 64)
    print(f"vLLM EngineCore SIGKILL on {victim} ({survivor} survived): {STREAMS}/{STREAMS} greedy streams "
          f"identical to the uninterrupted run, {moved:.0f} migrated, {elapsed:.1f}s from kill to last token; "
          f"{victim} exited {gone.returncode}, nothing placed on it while down"
          f"{' (it was back before the check)' if restarted_meanwhile else ''}; serving again "
          f"{back_after:.0f}s after the kill")
