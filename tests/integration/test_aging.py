"""Aging over real processes: under a continuous P0 load that keeps the P0
queue non-empty, a P2 request is still served, because waiting moves it up a
class every second (scheduler.aging set to 1 s here instead of 30 s).

Its own mesh (scheduler, four one-slot sim engines, gateway, Envoy): the
short aging thresholds would break the strict-priority checks of
test_scheduling.py. The P2 request comes from its own tenant, so GetState
shows its class as it moves up.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import aiohttp
import pytest

from services.common.config import MeshConfig
from services.launcher.mesh import Mesh

from ._support import chat, get_state, mesh_running, wait_idle, wait_state

pytestmark = pytest.mark.e2e

ENGINES = 4
P0_CLIENTS = 8           # twice the slots: P0 requests are always waiting
BATCH_KEY = "batch-tenant-test-key"
BATCH_TENANT = "batch"


def _tune(config: MeshConfig) -> None:
    t = config.engines.template
    t.max_running = 1
    t.total_blocks = 512
    s = config.scheduler
    s.engine_queue_slack = 0
    s.aging.p1_seconds = 1.0
    s.aging.p2_seconds = 1.0


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    yield from mesh_running(tmp_path_factory.mktemp("aging-mesh"), _tune, engines=ENGINES,
                            extra_keys={BATCH_KEY: BATCH_TENANT})


async def test_p2_is_served_under_continuous_p0_load(mesh: Mesh) -> None:
    await wait_idle(mesh)
    stop = asyncio.Event()
    p0_done = 0
    p0_failed: list[dict] = []

    async def p0_client(session: aiohttp.ClientSession, n: int) -> None:
        nonlocal p0_done
        i = 0
        while not stop.is_set():
            r = await chat(session, mesh, f"interactive {n}-{i}", 12, priority=0)
            if r.status != 200:
                p0_failed.append(r.error)
            p0_done += 1
            i += 1

    batch_classes: set[int] = set()
    p0_waiting_while_batch_queued = 0
    watching = asyncio.Event()

    async def watch() -> None:
        nonlocal p0_waiting_while_batch_queued
        while not watching.is_set():
            state = await get_state(mesh)
            mine = [q.priority for q in state.queues if q.tenant == BATCH_TENANT and q.queued]
            if mine:
                batch_classes.update(mine)
                others = sum(q.queued for q in state.queues if q.tenant != BATCH_TENANT and q.priority == 0)
                p0_waiting_while_batch_queued = max(p0_waiting_while_batch_queued, others)
            await asyncio.sleep(0.02)

    async with aiohttp.ClientSession() as session:
        load = [asyncio.create_task(p0_client(session, n)) for n in range(P0_CLIENTS)]
        try:
            await wait_state(mesh, lambda s: sum(q.queued for q in s.queues if q.priority == 0) >= 2,
                             "a standing P0 queue")
            watcher = asyncio.create_task(watch())
            done_before = p0_done
            batch = await asyncio.wait_for(
                chat(session, mesh, "nightly batch job", 4, priority=2, key=BATCH_KEY), timeout=60)
            served_meanwhile = p0_done - done_before
            watching.set()
            await watcher
        finally:
            stop.set()
            await asyncio.gather(*load)
    assert batch.status == 200 and batch.usage["completion_tokens"] == 4, batch.error
    assert p0_failed == []
    # It really waited behind P0 work: P0 requests were queued while it was,
    # and P0 requests kept completing while it waited.
    assert p0_waiting_while_batch_queued >= 1
    assert served_meanwhile >= ENGINES
    # And it got out by aging: it was seen queued in a better class than P2.
    assert 2 in batch_classes and min(batch_classes) < 2, batch_classes
