"""Aging over real processes: under a continuous P0 load that keeps the P0
queue non-empty, a P2 request is still served, because waiting moves it up a
class every second (scheduler.aging set to 1 s here instead of 30 s).

Its own mesh (scheduler, four one-slot sim engines, gateway, Envoy): the
short aging thresholds would break the strict-priority checks of
test_scheduling.py. The P2 request comes from its own tenant, so GetState
shows it waiting; the scheduler's promotion counter shows it moving up.
"""

from __future__ import annotations

import asyncio
import re
import urllib.request
from collections.abc import Iterator

import aiohttp
import pytest

from services.common.config import MeshConfig
from services.launcher.mesh import Mesh

from ._support import chat, mesh_running, wait_idle, wait_state

pytestmark = pytest.mark.e2e

ENGINES = 4
P0_CLIENTS = 16          # four times the slots: P0 requests are always waiting
# Long enough (~0.5 s each) that the engines, not the gateway, limit the P0
# load: 12 requests always wait, and draining them would take longer than a
# gateway stall on a noisy machine.
P0_TOKENS = 64
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


def _promotions(mesh: Mesh) -> dict[tuple[str, str], float]:
    """kvmesh_scheduler_promotions_total by (from, to) class, from the
    scheduler's Prometheus endpoint."""
    url = f"http://127.0.0.1:{mesh.config.scheduler.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    out = {}
    for line in text.splitlines():
        m = re.match(r'kvmesh_scheduler_promotions_total\{from_priority="P(\d)",to_priority="P(\d)"\} (\S+)', line)
        if m:
            out[(m.group(1), m.group(2))] = float(m.group(3))
    return out


async def test_p2_is_served_under_continuous_p0_load(mesh: Mesh) -> None:
    await wait_idle(mesh)
    stop = asyncio.Event()
    p0_done = 0
    p0_failed: list[dict] = []

    async def p0_client(session: aiohttp.ClientSession, n: int) -> None:
        nonlocal p0_done
        i = 0
        while not stop.is_set():
            r = await chat(session, mesh, f"interactive {n}-{i}", P0_TOKENS, priority=0)
            if r.status != 200:
                p0_failed.append(r.error)
            p0_done += 1
            i += 1

    def p0_queued(state) -> int:
        return sum(q.queued for q in state.queues if q.priority == 0)

    async with aiohttp.ClientSession() as session:
        load = [asyncio.create_task(p0_client(session, n)) for n in range(P0_CLIENTS)]
        try:
            await wait_state(mesh, lambda s: p0_queued(s) >= ENGINES, "a standing P0 queue")
            done_before = p0_done
            batch = asyncio.create_task(chat(session, mesh, "nightly batch job", 4, priority=2, key=BATCH_KEY))
            # Seen waiting as P2 behind queued P0 work.
            await wait_state(mesh, lambda s: p0_queued(s) >= 1 and any(
                q.tenant == BATCH_TENANT and q.priority == 2 and q.queued for q in s.queues),
                "the P2 request queued behind P0 requests")
            result = await asyncio.wait_for(batch, timeout=60)
            served_meanwhile = p0_done - done_before
        finally:
            stop.set()
            await asyncio.gather(*load)
    assert result.status == 200 and result.usage["completion_tokens"] == 4, result.error
    assert p0_failed == []
    # P0 requests kept completing while it waited ...
    assert served_meanwhile >= ENGINES
    # ... and it got out by aging: the only P2 request moved up to P1, then
    # (P0 requests never ran out) to P0, where it was served.
    promotions = _promotions(mesh)
    assert promotions.get(("2", "1"), 0) >= 1 and promotions.get(("1", "0"), 0) >= 1, promotions
