"""Priority across scheduler replicas on a real mesh (README "Several
schedulers"; services/scheduler/peer_heads.py): two scheduler replicas, one
gateway, one sim engine with a single lease slot for P1/P2 work (real
processes on free ports).

A P2 backlog owned by one replica (the gateway picks a request's replica by
rendezvous hashing of its x-request-id; the test chooses ids that rank it
first) fills the slot and queues; then P1 requests owned by the OTHER
replica arrive. Every time the slot frees, both replicas hear of it from the
engine at once; without a word between them whichever dispatches first
takes it, so P2s of the first replica went ahead of the waiting P1s. With
queue heads exchanged, the P2 replica leaves the slot to the P1s: every P1
starts before every P2 that was still waiting when the P1s came."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest
from _mesh_stop import stop_test_mesh
from _streams import eventually

from services.bench.scheduler_classes import scheduler_state
from services.gateway.scheduler_replicas import rendezvous_order
from services.launcher.mesh import Mesh

ROOT = Path(__file__).resolve().parents[2]
P2_BACKLOG = 6
P1_LATE = 3
TOKENS = 24
TIMEOUT = 120.0


@pytest.fixture(scope="module")
def one_slot_two_schedulers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    from services.common.config import load_config
    from services.launcher.mesh import MeshOptions, start_on_free_ports

    if not (ROOT / ".models" / "tiny-llama").is_dir():
        pytest.skip(".models/tiny-llama is missing: run `make setup`")
    config = load_config(ROOT / "config" / "kvmesh.yaml")
    config.engines.template.sim.speed_factor = 0.5
    # 2 lease slots, 1 kept for P0: one request of P1/P2 at a time, so the
    # order of first tokens is the order of placements.
    config.engines.template.max_running = 2
    config.scheduler.engine_queue_slack = 0
    # The bound's hold, long against a loaded machine's report delays: the
    # test asserts the rule, not how fast this machine passes heads on.
    config.scheduler.peers.hold_seconds = 10.0
    options = MeshOptions(engines=1, backend="sim", gateways=1, schedulers=2, model="tiny-llama",
                          free_ports=True, run_dir=tmp_path_factory.mktemp("mesh"))
    mesh = start_on_free_ports(config, options)
    try:
        yield mesh
    finally:
        stop_test_mesh(mesh)


@dataclass
class _Run:
    request_id: str
    priority: int
    sent: float = 0.0
    first_token: float = 0.0
    text: str = ""
    error: str = ""


def _ids(prefix: str, owner: str, addresses: list[str], n: int) -> list[str]:
    """`n` request ids that rank `owner` first among the replicas."""
    ids: list[str] = []
    i = 0
    while len(ids) < n:
        rid = f"{prefix}-{i}"
        if rendezvous_order(rid, addresses)[0] == owner:
            ids.append(rid)
        i += 1
    return ids


async def _stream(session: aiohttp.ClientSession, mesh: Mesh, run: _Run) -> None:
    body = {"model": mesh.config.engines.template.model, "prompt": f"tell me about {run.request_id}",
            "max_tokens": TOKENS, "stream": True, "temperature": 0, "ignore_eos": True}
    headers = {"Authorization": f"Bearer {mesh.api_key}", "x-request-id": run.request_id,
               "X-Priority": str(run.priority)}
    run.sent = time.monotonic()
    async with session.post(f"{mesh.endpoints.gateway_http[0]}/v1/completions", json=body,
                            headers=headers) as resp:
        if resp.status != 200:
            run.error = f"{resp.status}: {(await resp.text())[:200]}"
            return
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            event = json.loads(line[5:])
            if "error" in event:
                run.error = json.dumps(event["error"])[:200]
            for choice in event.get("choices", ()):
                if choice.get("text") and not run.first_token:
                    run.first_token = time.monotonic()
                run.text += choice.get("text") or ""


async def test_a_free_slot_goes_to_the_p1_of_the_other_replica(one_slot_two_schedulers: Mesh) -> None:
    mesh = one_slot_two_schedulers
    addresses = list(mesh.endpoints.schedulers)
    assert len(addresses) == 2
    # Both replicas list the engine as fresh and hear each other.
    await eventually(lambda: all((s := scheduler_state(a, timeout=1.0)) is not None and len(s.peers) == 1
                                 and any(e.fresh and e.serving for e in s.engines) for a in addresses),
                     60.0, "both replicas with the engine and each other")
    backlog = [_Run(rid, 2) for rid in _ids("p2", addresses[0], addresses, P2_BACKLOG)]
    late = [_Run(rid, 1) for rid in _ids("p1", addresses[1], addresses, P1_LATE)]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT)) as session:
        first = [asyncio.create_task(_stream(session, mesh, run)) for run in backlog]
        await _until(lambda: any(run.first_token or run.error for run in backlog) or any(t.done() for t in first),
                     "the first P2 runs")
        assert not [r for r in backlog if r.error], [(r.request_id, r.error) for r in backlog if r.error]
        # Let the slot turn over once (a P2 placed by its own replica while nothing else waits).
        p1s_sent_at = time.monotonic()
        waiting_p2 = [run for run in backlog if not run.first_token]
        second = [asyncio.create_task(_stream(session, mesh, run)) for run in late]
        await asyncio.gather(*first, *second)
    runs = backlog + late
    assert not [r for r in runs if r.error], [(r.request_id, r.error) for r in runs if r.error]
    assert all(r.first_token for r in runs)
    assert len(waiting_p2) >= P2_BACKLOG - 2, "the P2 backlog was still queued when the P1s came"
    order = sorted(runs, key=lambda r: r.first_token)
    p1_last = max(r.first_token for r in late)
    overtaking = [r.request_id for r in waiting_p2 if r.first_token < p1_last]
    assert not overtaking, (
        f"P2s waiting at {addresses[0]} when the P1s came at {p1s_sent_at:.2f} started before a P1 of "
        f"{addresses[1]}: order {[(r.request_id, round(r.first_token - p1s_sent_at, 2)) for r in order]}")


async def _until(predicate: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + TIMEOUT
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"never: {what}")
        await asyncio.sleep(0.02)
