"""Nothing lost: engines SIGKILLed or drained and the scheduler SIGKILLed
under load, on a real mesh (scheduler, two sim engines, gateway, Envoy: real
processes on free ports). The sim's text is a pure function of the tokens
before it (like greedy decoding), so every stream's text is compared with an
uninterrupted run of the same request: no token repeated, none missing."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time

import aiohttp
import pytest
from _streams import (
    StreamResult,
    eventually,
    gateway_counter,
    run_streams,
    scheduler_state,
    sim_unthrottled,
    wait_until,
)

from services.common.config import MeshConfig
from services.common.proto.kvmesh.v1 import scheduler_pb2
from services.launcher.mesh import Mesh

STREAMS = 50
LONG_TOKENS = 400
# ~30 s of decode: past a scheduler's restart however loaded the machine.
HOLD_TOKENS = 6000
# Long enough to outlive the drain timeout by seconds however late the test
# sends SIGTERM on a loaded machine (400 tokens took ~2 s: too close to it).
DRAIN_LONG_TOKENS = 1600
# A stop string no answer contains: the engine holds back text for it all the same.
NEVER_STOP = "\x00\x01\x02\x03"


def MESH_TUNE(config: MeshConfig) -> None:  # noqa: N802 - the fixture's hook name
    # The drain timeout: long streams outlive it (and migrate), short ones finish.
    config.engines.template.stop_grace_seconds = 1.5
    # Room for only part of the load: some requests wait in the queue, so a
    # scheduler restart meets queued and running requests both.
    config.engines.template.max_running = 16


def _prompts(tag: str, n: int) -> list[str]:
    return [f"{tag} request {i}: tell me a long story about meshes and engines." for i in range(n)]


async def _finish(tasks: list[asyncio.Task[StreamResult]], session: aiohttp.ClientSession) -> list[StreamResult]:
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        await session.close()


async def _expected(mesh: Mesh, prompts: list[str], max_tokens: list[int],
                    stops: list[list[str] | None] | None = None, unthrottled: bool = True) -> list[str]:
    """The uninterrupted answers (same mesh, nothing killed; the sim
    unthrottled unless `unthrottled` is False: every engine must answer)."""
    with sim_unthrottled(mesh) if unthrottled else contextlib.nullcontext():
        _, tasks, session = await run_streams(mesh, prompts, max_tokens, stops)
        results = await _finish(tasks, session)
    bad = [r for r in results if not r.ok]
    assert not bad, f"baseline run failed: {bad[0]}"
    return [r.text for r in results]


def _assert_same(results: list[StreamResult], expected: list[str]) -> None:
    failed = [(i, r.status, r.finish_reason, r.error) for i, r in enumerate(results) if not r.ok]
    assert not failed, f"{len(failed)} streams did not complete: {failed[:5]}"
    for i, (got, want) in enumerate(zip((r.text for r in results), expected, strict=True)):
        assert got == want, (
            f"stream {i} differs from the uninterrupted run at char "
            f"{next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))}"
            f" (got {len(got)} chars, want {len(want)})")


def _engine(state: scheduler_pb2.SchedulerState | None, engine_id: str) -> scheduler_pb2.EngineState | None:
    return next((e for e in state.engines if e.engine_id == engine_id), None)


async def _rejoined(mesh: Mesh, engine_id: str) -> None:
    def ok() -> bool:
        state = scheduler_state(mesh)
        e = None if state is None else _engine(state, engine_id)
        return e is not None and e.serving and e.fresh and not e.draining
    await wait_until(ok, 60, f"{engine_id} to re-register with the scheduler")


async def test_engine_sigkill_mid_stream_loses_nothing(e2e_mesh: Mesh) -> None:
    mesh = e2e_mesh
    prompts, lengths = _prompts("kill", STREAMS), [LONG_TOKENS] * STREAMS
    # Every other stream has a stop string (never matched): its engine holds
    # back the tail of its text, which must cross the seam too.
    stops = [[NEVER_STOP] if i % 2 else None for i in range(STREAMS)]
    expected = await _expected(mesh, prompts, lengths, stops)
    migrations = gateway_counter(mesh, "kvmesh_gateway_migrations_total")

    results, tasks, session = await run_streams(mesh, prompts, lengths, stops)
    # Dozens of streams are mid-answer (the rest wait in the queue) when the engine dies.
    await wait_until(lambda: sum(r.chunks >= 3 and not r.done for r in results) >= 30, 60,
                     "30 streams to be mid-answer")
    killed_at = time.monotonic()
    mesh.kill("engine-0")
    results = await _finish(tasks, session)
    elapsed = time.monotonic() - killed_at

    _assert_same(results, expected)
    moved = gateway_counter(mesh, "kvmesh_gateway_migrations_total") - migrations
    assert moved >= 1, "no stream migrated: did engine-0 hold none?"
    print(f"engine SIGKILL: {STREAMS} streams complete and identical, {moved:.0f} migrated, "
          f"{elapsed:.1f}s from kill to last token")

    # A restarted engine rejoins (fresh KV state) and takes work again.
    mesh.restart("engine-0")
    await _rejoined(mesh, "engine-0")
    assert mesh.exited() == []


async def test_scheduler_sigkill_under_load_loses_nothing(e2e_mesh: Mesh) -> None:
    mesh = e2e_mesh
    prompts, lengths = _prompts("sched", STREAMS), [LONG_TOKENS] * STREAMS
    late_prompts = _prompts("late", 10)
    expected = await _expected(mesh, prompts + late_prompts, lengths + [64] * 10)
    reattached = gateway_counter(mesh, "kvmesh_gateway_scheduler_readmissions_total", 'state="running"')
    readmitted = gateway_counter(mesh, "kvmesh_gateway_scheduler_readmissions_total", 'state="queued"')

    # Two streams that outlive any restart of the scheduler: the 400-token
    # ones (~2 s) had all ended by the time a restart on a loaded machine
    # was healthy, and no running lease was left to re-attach. Cancelled once
    # a running lease re-attached (their text is not compared).
    holders, holder_tasks, holder_session = await run_streams(mesh, _prompts("hold", 2), [HOLD_TOKENS] * 2)
    await wait_until(lambda: all(r.chunks > 0 for r in holders), 60, "the two holding streams to be running")
    results, tasks, session = await run_streams(mesh, prompts, lengths)
    # Two engines x 16 running: the rest wait in the scheduler's queue.
    await wait_until(lambda: sum(r.chunks > 0 for r in results) >= 20, 60, "streams to be running")
    state = scheduler_state(mesh)
    assert state is not None and state.queued_total > 0, "expected some requests to be queued"
    killed_at = time.monotonic()
    mesh.kill("scheduler")
    # Requests that arrive while the scheduler is down wait for it.
    late, late_tasks, late_session = await run_streams(mesh, late_prompts, [64] * 10)
    mesh.restart("scheduler")
    restarted_in = time.monotonic() - killed_at

    # Running requests re-attach their leases on the new scheduler.
    def leases() -> int:
        s = scheduler_state(mesh)
        return 0 if s is None else s.leases_total
    await wait_until(lambda: leases() > 0, 30, "leases to be re-attached")
    # A /metrics scrape blocks: in a thread, so the 52 streams on this loop keep being read.
    await eventually(lambda: gateway_counter(mesh, "kvmesh_gateway_scheduler_readmissions_total",
                                             'state="running"') > reattached, 60, "a running lease to re-attach")
    assert not any(r.done for r in holders), "a holding stream ended before the restart"
    for task in holder_tasks:
        task.cancel()
    await asyncio.gather(*holder_tasks, return_exceptions=True)
    await holder_session.close()
    results = await _finish(tasks, session)
    late = await _finish(late_tasks, late_session)
    elapsed = time.monotonic() - killed_at

    _assert_same(results + late, expected)
    again = gateway_counter(mesh, "kvmesh_gateway_scheduler_readmissions_total", 'state="running"') - reattached
    queued = gateway_counter(mesh, "kvmesh_gateway_scheduler_readmissions_total", 'state="queued"') - readmitted
    assert again >= 1 and queued >= 1, (again, queued)
    print(f"scheduler SIGKILL: {STREAMS + 10} streams complete and identical ({again:.0f} re-attached, "
          f"{queued:.0f} re-admitted); scheduler healthy again {restarted_in:.1f}s after the kill, "
          f"last token {elapsed:.1f}s after it")
    # Everything settles: no lease or queue entry outlives its request.
    await wait_until(lambda: (s := scheduler_state(mesh)) is not None and s.leases_total == 0
                     and s.queued_total == 0, 30, "leases and queues to drain")
    await _rejoined(mesh, "engine-0")
    await _rejoined(mesh, "engine-1")


async def test_engine_sigterm_drains_then_hands_over(e2e_mesh: Mesh) -> None:
    mesh = e2e_mesh
    n = 24
    prompts = _prompts("drain", n)
    # Half finish within the drain timeout, half outlive it and migrate.
    lengths = [30 if i % 2 else DRAIN_LONG_TOKENS for i in range(n)]
    after_prompts = _prompts("after", 10)
    expected = await _expected(mesh, prompts + after_prompts, lengths + [24] * 10)
    migrations = gateway_counter(mesh, "kvmesh_gateway_migrations_total")

    results, tasks, session = await run_streams(mesh, prompts, lengths)
    await wait_until(lambda: all(r.chunks > 0 for r in results), 60, "every stream to be running")
    before = _engine(scheduler_state(mesh), "engine-1")
    assert before is not None and before.leases > 0, "engine-1 holds no stream"
    mesh.terminate("engine-1")

    # The scheduler learns the engine is going (serving false) or gone ...
    def not_serving() -> bool:
        e = _engine(scheduler_state(mesh), "engine-1")
        return e is None or not e.serving
    await wait_until(not_serving, 10, "the scheduler to see engine-1 draining")
    # ... and places nothing new there: its leases only go down.
    seen = [(_engine(scheduler_state(mesh), "engine-1") or before).leases]
    after, after_tasks, after_session = await run_streams(mesh, after_prompts, [24] * 10)
    while not all(t.done() for t in after_tasks):
        e = _engine(scheduler_state(mesh), "engine-1")
        seen.append(0 if e is None else e.leases)
        await asyncio.sleep(0.05)
    assert all(b <= a for a, b in itertools.pairwise(seen)), f"new work was placed on a draining engine: {seen}"

    results = await _finish(tasks, session)
    after = await _finish(after_tasks, after_session)
    _assert_same(results + after, expected)
    assert mesh.wait("engine-1", timeout=30) == 0, "engine-1 did not exit cleanly after draining"
    moved = gateway_counter(mesh, "kvmesh_gateway_migrations_total") - migrations
    assert moved >= 1, "no long stream was handed over at the drain timeout"
    print(f"engine SIGTERM: {n + 10} streams complete and identical, {moved:.0f} handed over")

    mesh.restart("engine-1")
    await _rejoined(mesh, "engine-1")
    assert mesh.exited() == []


pytestmark = pytest.mark.timeout(300)
