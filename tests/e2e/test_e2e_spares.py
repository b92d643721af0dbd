"""Warm spares on a real mesh (issue 28): scheduler, two sim engines, gateway,
Envoy. With `scheduler.spares.count: 1` one engine serves and the other is
held as a spare (GetState `spare`); a burst of P0 streams larger than the
serving engine's lease slots makes the queued P0 work miss its first-token
target, the scheduler promotes the spare and placements reach it; when the
burst is over and the model has been calm for the hold, the idle engine
returns to spare. Every stream completes (nothing lost)."""

from __future__ import annotations

import asyncio
import urllib.request

import aiohttp
import pytest
from _streams import StreamResult, scheduler_state, stream_completion, wait_until

from services.common.config import MeshConfig, SparesConfig
from services.common.proto.kvmesh.v1 import scheduler_pb2
from services.launcher.mesh import Mesh

pytestmark = pytest.mark.e2e

BURST = 16
TOKENS = 120
HOLD_SECONDS = 3.0


def MESH_TUNE(config: MeshConfig) -> None:  # noqa: N802 - the fixture's hook name
    config.engines.template.max_running = 4
    config.scheduler.engine_queue_slack = 0
    config.scheduler.p0_reserved_leases = 0
    config.scheduler.preempt_classes = []       # room comes from the spare, not from preemption
    config.scheduler.spares = SparesConfig(count=1, demote_hold_seconds=HOLD_SECONDS)


def _state(mesh: Mesh) -> scheduler_pb2.SchedulerState | None:
    return scheduler_state(mesh)


def _spares(state: scheduler_pb2.SchedulerState | None) -> list[str]:
    return [] if state is None else [e.engine_id for e in state.engines if e.spare]


def _one_spare(mesh: Mesh) -> bool:
    state = _state(mesh)
    return (state is not None and len(state.engines) == 2 and all(e.serving and e.fresh for e in state.engines)
            and len(_spares(state)) == 1)


def _scheduler_metric(mesh: Mesh, name: str) -> float:
    port = mesh.config.scheduler.metrics_port
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith((name + "{", name + " ")))


async def test_a_burst_promotes_the_spare_and_it_returns_when_load_falls(e2e_mesh: Mesh) -> None:
    mesh = e2e_mesh
    await wait_until(lambda: _one_spare(mesh), 60, "one serving engine and one spare")
    spare = _spares(_state(mesh))[0]
    leased_on_spare = 0

    async def watch() -> None:
        nonlocal leased_on_spare
        while True:
            state = await asyncio.to_thread(_state, mesh)
            for e in state.engines if state is not None else ():
                if e.engine_id == spare and not e.spare:
                    leased_on_spare = max(leased_on_spare, e.leases)
            await asyncio.sleep(0.05)

    watcher = asyncio.create_task(watch())
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        results = [StreamResult() for _ in range(BURST)]
        await asyncio.gather(*(stream_completion(session, mesh, f"Burst {i}: tell a long story about ships.",
                                                 TOKENS, r, priority=0) for i, r in enumerate(results)))
    watcher.cancel()
    failed = [(r.status, r.finish_reason, r.error) for r in results if not r.ok]
    assert not failed, f"streams lost or failed: {failed}"
    assert all(r.chunks > 0 for r in results)
    promotions = await asyncio.to_thread(_scheduler_metric, mesh, "kvmesh_scheduler_spare_promotions_total")
    print(f"promotions {promotions:g}; most leases seen on the promoted spare {spare}: {leased_on_spare}")
    assert promotions >= 1, "the burst did not promote the spare"
    assert leased_on_spare > 0, "no placement reached the promoted spare"
    # Load fell: after the calm hold the idle engine returns to spare.
    await wait_until(lambda: _one_spare(mesh), 60 + 10 * HOLD_SECONDS, "an engine back to spare after the burst")
    returns = await asyncio.to_thread(_scheduler_metric, mesh, "kvmesh_scheduler_spare_returns_total")
    assert returns >= 2   # at start-up and after the burst
    placed = await asyncio.to_thread(_scheduler_metric, mesh, "kvmesh_scheduler_spare_promotion_seconds_count")
    assert placed >= 1
