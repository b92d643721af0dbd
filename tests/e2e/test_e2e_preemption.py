"""Interactive requests never wait behind batch work (issue 13), on a real
mesh: scheduler, two sim engines, gateway, Envoy (real processes, free ports).

Scaled to a minute on two cores: each engine runs 4 sequences (+ 1 lease of
engine queue slack) and keeps no lease for P0 (`p0_reserved_leases: 0`), so
twelve P2 streams hold every lease slot and a P0 can only start at once if the
scheduler preempts one of them. The assertions are about behaviour, not
speed: a P0's first token comes far sooner than a P2 stream takes to finish
(measured in the same run), the scheduler reports the preemptions, and every
preempted P2 stream still completes with the text of an uninterrupted run
(the sim's text is a pure function of the tokens before it, like greedy
decoding). The burst test sends 300 requests of one tenant at once with the
tenant's queue cap at 150: no P0 may be refused while a P1 or P2 request of
that tenant waits in the queue (judged from GetState snapshots around each
refusal).
"""

from __future__ import annotations

import asyncio
import bisect
import random
import statistics
import time

import aiohttp
import pytest
from _streams import scheduler_state, sim_unthrottled, wait_until

from services.bench.scheduler_classes import class_figures
from services.bench.timed_stream import ChatCall, TimedStream, chat_stream
from services.common.config import MeshConfig
from services.launcher.mesh import Mesh

pytestmark = pytest.mark.e2e

P2_STREAMS = 12
P2_TOKENS = 500
P0_REQUESTS = 5
P0_TOKENS = 16
BURST = 300
TENANT_CAP = 150
TENANT = "dev"  # the launcher's generated key


def MESH_TUNE(config: MeshConfig) -> None:  # noqa: N802 - the fixture's hook name
    t = config.engines.template
    t.max_running = 4
    # Full simulated speed (~9 ms a step at 4 sequences): a 500-token P2
    # stream takes ~4.5 s, long enough to be preempted, short enough for CI.
    t.sim.speed_factor = 1.0
    config.scheduler.engine_queue_slack = 1
    # No lease kept for P0: the scheduler itself must make room.
    config.scheduler.p0_reserved_leases = 0
    config.scheduler.tenant_queue_cap = TENANT_CAP


def _call(mesh: Mesh, user: str, max_tokens: int, priority: int) -> ChatCall:
    return ChatCall(mesh.endpoints.public_http, mesh.api_key, mesh.config.engines.template.model, user,
                    max_tokens, priority, timeout_seconds=180)


def _p2_calls(mesh: Mesh) -> list[ChatCall]:
    return [_call(mesh, f"Batch job {i}: write the long ledger report number {i}.", P2_TOKENS, 2)
            for i in range(P2_STREAMS)]


def _failed(streams: list[TimedStream]) -> list[tuple[str, int, str | None, str]]:
    return [(s.call.user, s.status, s.finish_reason, s.error[:120]) for s in streams
            if not s.ok or s.completion_tokens != s.call.max_tokens]


async def _leases_full(mesh: Mesh, leases: int) -> bool:
    state = await asyncio.to_thread(scheduler_state, mesh)
    return state is not None and state.leases_total >= leases and state.queued_total > 0


async def test_p0_is_not_held_behind_running_p2_and_p2_loses_nothing(e2e_mesh: Mesh) -> None:
    mesh = e2e_mesh
    leases = mesh.config.engines.count * (mesh.config.engines.template.max_running
                                          + mesh.config.scheduler.engine_queue_slack)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        # The uninterrupted texts: the same requests with no P0 around (the
        # sim unthrottled: only their text counts).
        with sim_unthrottled(mesh):
            reference = await asyncio.gather(*(chat_stream(session, c) for c in _p2_calls(mesh)))
        assert not _failed(list(reference)), f"reference run failed: {_failed(list(reference))}"
        before = class_figures(await asyncio.to_thread(scheduler_state, mesh)).get(2, {})

        p2_tasks = [asyncio.create_task(chat_stream(session, c)) for c in _p2_calls(mesh)]
        full = False
        deadline = time.monotonic() + 60
        while not full and time.monotonic() < deadline:
            full = await _leases_full(mesh, leases)
            await asyncio.sleep(0.05)
        assert full, f"the P2 streams did not take all {leases} lease slots"
        p0: list[TimedStream] = []
        for i in range(P0_REQUESTS):
            if i:
                await asyncio.sleep(0.2)
            p0.append(await chat_stream(session, _call(mesh, f"Quick question {i}: capital of France?",
                                                       P0_TOKENS, 0)))
        p2 = list(await asyncio.gather(*p2_tasks))
    after = class_figures(await asyncio.to_thread(scheduler_state, mesh)).get(2, {})

    ttfts = [round(s.ttft, 3) if s.ttft is not None else None for s in p0]
    durations = [s.generation_seconds for s in p2 if s.generation_seconds is not None]
    typical = statistics.median(durations) if durations else 0.0
    preempted = after.get("preemptions", 0.0) - before.get("preemptions", 0.0)
    print(f"P0 TTFT s: {ttfts}; P2 stream median generation {typical:.2f} s; "
          f"P2 preemptions (GetState): {preempted:g}; P2 classes after: {after}")
    # (d) nothing lost: every request completes, no error event, full length.
    assert not _failed(p0), f"P0 requests failed: {_failed(p0)}"
    assert not _failed(p2), f"P2 streams failed: {_failed(p2)}"
    # (c) each P2 stream's text is its uninterrupted text.
    for got, want in zip(p2, reference, strict=True):
        assert got.text == want.text, (
            f"{got.call.user!r} differs from the uninterrupted run at char "
            f"{next((k for k, (a, b) in enumerate(zip(got.text, want.text)) if a != b), len(got.text))}")
    # (a) no P0 waited for a P2 stream to end: each first token within a
    # quarter of the time a P2 stream takes to stream its answer.
    slow = [t for t in ttfts if t is None or t >= typical / 4]
    assert not slow, (f"P0 TTFTs {ttfts} s: {len(slow)} at or above a quarter of a P2 stream's "
                      f"{typical:.2f} s -- a P0 waited for batch work to finish")
    # (b) the scheduler made the room, and says so.
    assert preempted > 0, f"GetState shows no P2 preemption (classes: {after or 'not filled'})"


class _QueuePoller:
    """GetState every 20 ms: (time, P1 + P2 of TENANT queued)."""

    def __init__(self, mesh: Mesh) -> None:
        self.mesh = mesh
        self.times: list[float] = []
        self.lower: list[int] = []
        self.stop = asyncio.Event()

    async def run(self) -> None:
        while not self.stop.is_set():
            state = await asyncio.to_thread(scheduler_state, self.mesh)
            if state is not None:
                self.times.append(time.monotonic())
                self.lower.append(sum(q.queued for q in state.queues if q.tenant == TENANT and q.priority > 0))
            await asyncio.sleep(0.02)

    def lower_queued_around(self, t: float) -> bool:
        k = bisect.bisect_right(self.times, t)
        return 0 < k < len(self.times) and self.lower[k - 1] > 0 and self.lower[k] > 0


async def test_burst_p0_never_refused_while_lower_class_of_tenant_queued(e2e_mesh: Mesh) -> None:
    mesh = e2e_mesh
    priorities = [i % 3 for i in range(BURST)]
    random.Random(13).shuffle(priorities)
    calls = [_call(mesh, f"Burst {i} (P{p}): name three rivers.", 8, p) for i, p in enumerate(priorities)]
    poller = _QueuePoller(mesh)
    poll = asyncio.create_task(poller.run())
    await wait_until(lambda: len(poller.times) >= 2, 30, "GetState snapshots")
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            streams = list(await asyncio.gather(*(chat_stream(session, c) for c in calls)))
    finally:
        poller.stop.set()
        await poll

    refused = [s for s in streams if s.status == 429]
    by_class = {p: sum(s.call.priority == p for s in refused) for p in range(3)}
    bad = [s for s in refused if s.call.priority == 0
           and poller.lower_queued_around(s.answered or s.ended or s.sent)]
    print(f"burst of {BURST}: 429 per class {by_class}; P0 refused while a lower class of the tenant "
          f"was queued: {len(bad)}; max lower-class queued {max(poller.lower, default=0)}")
    others = [(s.status, s.error[:120]) for s in streams if not s.ok and s.status != 429]
    assert not others, f"requests failed otherwise than 429: {others[:5]}"
    assert refused, "nothing was refused: the tenant cap did not bind"
    assert all(s.retry_after for s in refused), "every 429 carries Retry-After"
    n_bad = len(bad)
    assert n_bad == 0, (f"{n_bad} P0 requests got 429 while P1/P2 requests of their tenant were queued "
                     f"(429 per class: {by_class})")
