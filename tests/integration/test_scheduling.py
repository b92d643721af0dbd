"""Scheduling over real processes: scheduler, four sim engines, a gateway
and the real Envoy, on free ports (one mesh for this module).

The engines are small on purpose (2 running sequences each, no extra lease
slack), so four engines hold 8 requests and saturation is one burst away.
User-facing behaviour (priorities, 429) goes through Envoy; placement is
observed from the scheduler's GetState and the engines' Prometheus counters.
The module's last test kills an engine, so it must stay last.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator

import aiohttp
import pytest

from services.common.config import MeshConfig
from services.launcher.mesh import Mesh

from ._support import (
    MODEL,
    auth,
    cancel_all,
    chat,
    counter_delta,
    engine_counter,
    get_state,
    mesh_running,
    wait_idle,
    wait_state,
)

pytestmark = pytest.mark.e2e

MAX_RUNNING = 2
ENGINES = 4
SLOTS = MAX_RUNNING * ENGINES
# [P0, P1, P2]: room for 50 queued P2 requests, a P1 class that fills fast.
QUEUE_CAPS = [10, 4, 60]
# Long enough to hold an engine slot for the whole of a test (the sim at
# speed 2 needs ~16 ms per token); the tests cancel them when done.
BLOCKER_TOKENS = 1900
SUCCESS = "vllm:request_success_total"


def _tune(config: MeshConfig) -> None:
    t = config.engines.template
    t.max_running = MAX_RUNNING
    t.total_blocks = 512
    t.sim.speed_factor = 2.0
    s = config.scheduler
    s.engine_queue_slack = 0          # lease limit = max_running: saturation is exact
    s.p0_reserved_leases = 0          # ... for every class alike
    s.queue_caps = list(QUEUE_CAPS)


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    yield from mesh_running(tmp_path_factory.mktemp("sched-mesh"), _tune, engines=ENGINES)


def _words(seed: int, n: int) -> str:
    rng = random.Random(seed)
    vocab = ["alpha", "river", "stone", "kernel", "mesh", "cache", "token", "window", "orbit",
             "paper", "lantern", "copper", "signal", "harbor", "meadow", "vector"]
    return " ".join(rng.choice(vocab) + str(rng.randrange(100)) for _ in range(n))


async def _start_blockers(session: aiohttp.ClientSession, mesh: Mesh) -> list[asyncio.Task]:
    """Fill every engine slot with a long generation; return their tasks.
    The blockers are P0: a P0 never waits for lower-class running work (it
    preempts it), so only P0 work keeps a newcomer of any class queued."""
    tasks = [asyncio.create_task(chat(session, mesh, f"blocker {i}", BLOCKER_TOKENS, priority=0))
             for i in range(SLOTS)]
    await wait_state(mesh, lambda s: s.leases_total == SLOTS and s.queued_total == 0,
                     f"{SLOTS} blockers holding every engine slot")
    return tasks


def _queued(state, priority: int) -> int:
    return sum(q.queued for q in state.queues if q.priority == priority)


# ---------------------------------------------------------------- placement


async def test_shared_prefix_sticks_to_one_engine_until_it_saturates(mesh: Mesh) -> None:
    await wait_idle(mesh)
    system = _words(7, 350)  # ~1k tokens of shared context
    async with aiohttp.ClientSession() as session:
        # One at a time: every request goes where the prefix is cached.
        before = engine_counter(mesh, SUCCESS)
        first = await chat(session, mesh, "question 0", system=system)
        assert first.status == 200, first.error
        home = next(e for e, n in counter_delta(before, engine_counter(mesh, SUCCESS)).items() if n == 1)
        prompt_blocks = first.usage["prompt_tokens"] // 16
        # The scheduler learns the engine's cache from its KV events.
        await wait_state(mesh, lambda s: any(e.engine_id == home and e.cached_blocks >= prompt_blocks
                                             for e in s.engines), f"{home}'s KV events in the index")
        for i in range(1, 4):
            r = await chat(session, mesh, f"question {i}", system=system)
            assert r.status == 200, r.error
            assert r.usage["prompt_tokens_details"]["cached_tokens"] >= (prompt_blocks - 1) * 16
        sequential = counter_delta(before, engine_counter(mesh, SUCCESS))
        assert sequential[home] == 4 and sum(sequential.values()) == 4, sequential

        # A burst larger than the home engine's slots: it fills up, the rest spill.
        max_home_leases = 0
        done = asyncio.Event()

        async def watch() -> None:
            nonlocal max_home_leases
            while not done.is_set():
                state = await get_state(mesh)
                for e in state.engines:
                    if e.engine_id == home:
                        max_home_leases = max(max_home_leases, e.leases)
                await asyncio.sleep(0.02)

        watcher = asyncio.create_task(watch())
        before = engine_counter(mesh, SUCCESS)
        results = await asyncio.gather(*(chat(session, mesh, f"burst {i}", 48, system=system)
                                          for i in range(10)))
        done.set()
        await watcher
    assert all(r.status == 200 for r in results), [r.error for r in results if r.status != 200]
    burst = counter_delta(before, engine_counter(mesh, SUCCESS))
    assert max_home_leases == MAX_RUNNING, f"{home} never saturated: max leases {max_home_leases}"
    assert burst[home] >= MAX_RUNNING, burst
    assert sum(n for e, n in burst.items() if e != home) >= 1, f"nothing spilled: {burst}"


# ---------------------------------------------------------------- priorities


async def test_p0_is_placed_before_fifty_queued_p2(mesh: Mesh) -> None:
    await wait_idle(mesh)
    order: list[str] = []
    async with aiohttp.ClientSession() as session:
        blockers = await _start_blockers(session, mesh)
        try:
            batch = [asyncio.create_task(chat(session, mesh, f"batch job {i}", 2, priority=2,
                                              on_first_token=lambda i=i: order.append(f"p2-{i}")))  # type: ignore[misc]  # mypy cannot type a lambda with a default argument
                     for i in range(50)]
            await wait_state(mesh, lambda s: _queued(s, 2) == 50, "50 queued P2 requests")
            urgent = asyncio.create_task(chat(session, mesh, "urgent", 2, priority=0,
                                              on_first_token=lambda: order.append("p0")))
            state = await wait_state(mesh, lambda s: _queued(s, 0) == 1, "the P0 request queued")
            # Still saturated: nothing could have been placed yet.
            assert state.leases_total == SLOTS and _queued(state, 2) == 50 and order == []
            # Free exactly one slot: the next placement must be the P0 request.
            blockers[0].cancel()
            assert (await urgent).status == 200
            assert order[0] == "p0", order[:5]
        finally:
            await cancel_all(blockers)
        results = await asyncio.gather(*batch)
    assert [r.status for r in results] == [200] * 50
    assert sorted(order) == sorted(["p0", *(f"p2-{i}" for i in range(50))])


async def test_full_queue_answers_429_with_retry_after_through_envoy(mesh: Mesh) -> None:
    await wait_idle(mesh)
    async with aiohttp.ClientSession() as session:
        blockers = await _start_blockers(session, mesh)
        waiting: list[asyncio.Task] = []
        try:
            waiting = [asyncio.create_task(chat(session, mesh, f"waiting {i}", 2))
                       for i in range(QUEUE_CAPS[1])]
            await wait_state(mesh, lambda s: _queued(s, 1) == QUEUE_CAPS[1], "a full P1 queue")
            body = {"model": MODEL, "messages": [{"role": "user", "content": "one more"}], "max_tokens": 2}
            async with session.post(f"{mesh.endpoints.public_http}/v1/chat/completions", json=body,
                                    headers=auth(mesh.api_key)) as resp:
                status, headers, payload = resp.status, resp.headers, await resp.json()
            assert status == 429, payload
            assert int(headers["Retry-After"]) >= 1
            assert payload["error"]["type"] == "rate_limit_error" or payload["error"]["message"]
            # Another class still has room: a P0 request is queued, not refused.
            urgent = asyncio.create_task(chat(session, mesh, "urgent", 2, priority=0))
            await wait_state(mesh, lambda s: _queued(s, 0) == 1, "the P0 request queued")
            waiting.append(urgent)
        finally:
            await cancel_all(blockers)
        results = await asyncio.gather(*waiting)
    assert [r.status for r in results] == [200] * len(results)


# ---------------------------------------------------------------- failure (keep last)


async def test_killed_engine_leaves_placement_at_once(mesh: Mesh) -> None:
    await wait_idle(mesh)
    state = await get_state(mesh)
    assert sorted(e.engine_id for e in state.engines) == [f"engine-{i}" for i in range(ENGINES)]
    victim = "engine-3"
    mesh.kill(victim)  # SIGKILL: no goodbye, only a broken Connect stream
    # GetState keeps listing a merely stale engine (fresh=false); only the
    # end of its registration stream removes it, which SIGKILL causes at once.
    state = await wait_state(mesh, lambda s: victim not in {e.engine_id for e in s.engines},
                             f"{victim} gone from GetState", timeout=10)
    assert len(state.engines) == ENGINES - 1
    before = engine_counter(mesh, SUCCESS)
    async with aiohttp.ClientSession() as session:
        results = await asyncio.gather(*(chat(session, mesh, f"after the crash {i}", 4, priority=2)
                                       for i in range(12)))
    assert [r.status for r in results] == [200] * 12, [r.error for r in results]
    served = counter_delta(before, engine_counter(mesh, SUCCESS))
    assert victim not in served and sum(served.values()) == 12, served
