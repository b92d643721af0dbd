"""A silent partition of an engine, on a real mesh (scheduler, two sim
engines, gateway, Envoy: real processes on free ports): SIGSTOP of one
engine process with streams running. Its kernel still ACKs TCP but nothing
answers -- no reset, no FIN, exactly what a host cut off the network looks
like to its peers. Only keepalive can notice (services/common/grpc_server.py,
`network` in the config): the gateway's Generate streams to it end
UNAVAILABLE within keepalive_time + keepalive_timeout and migrate, the
scheduler drops its registration. SIGCONT later (the partition heals): the
engine re-registers, runs nothing it is not leased (its streams' connections
are gone; what it still held is fenced, services/scheduler/fencing.py), no
text is duplicated anywhere, and it serves again."""

from __future__ import annotations

import asyncio
import os
import signal
import time
import urllib.request

import grpc
import pytest
from _streams import engine_infos, eventually, gateway_counter, run_streams, scheduler_state, wait_until
from test_e2e_reliability import _assert_same, _engine, _expected, _finish, _prompts, _rejoined

from services.common.config import MeshConfig
from services.common.proto.kvmesh.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from services.launcher.mesh import Mesh

STREAMS = 16
TOKENS = 800
VICTIM = "engine-0"


def MESH_TUNE(config: MeshConfig) -> None:  # noqa: N802 - the fixture's hook name
    # This test is about the network: keep the hang detector (which would
    # also fire once the stopped engine runs again) out of it.
    config.engines.template.hang_floor_seconds = 300.0
    # And the gateway's stall watch (deadlines from live latency) too: it
    # moves a silent engine's streams after ~5 s, before keepalive's 10 s
    # (test_e2e_deadlines.py measures that); this test measures keepalive.
    config.deadlines.enabled = False


def _engine_counter(mesh: Mesh, index: int, name: str) -> float:
    port = mesh.config.engines.metrics_base_port + index
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def _registered(mesh: Mesh, engine_id: str) -> bool:
    state = scheduler_state(mesh)
    return state is not None and _engine(state, engine_id) is not None


async def _dropped_after(mesh: Mesh, since: float, timeout: float) -> float:
    await eventually(lambda: not _registered(mesh, VICTIM), timeout, f"the scheduler to drop {VICTIM}")
    return time.monotonic() - since


def _leases_on(mesh: Mesh, engine_id: str) -> int:
    state = scheduler_state(mesh)
    engine = None if state is None else _engine(state, engine_id)
    return 0 if engine is None else int(engine.leases)


async def test_engine_silently_partitioned_then_healed_loses_and_duplicates_nothing(e2e_mesh: Mesh) -> None:
    mesh = e2e_mesh
    network = mesh.config.network
    bound = network.detect_seconds
    prompts, lengths = _prompts("partition", STREAMS), [TOKENS] * STREAMS
    expected = await _expected(mesh, prompts, lengths)
    migrations = gateway_counter(mesh, "kvmesh_gateway_migrations_total")
    pid = mesh.pid(VICTIM)
    assert pid is not None

    results, tasks, session = await run_streams(mesh, prompts, lengths)
    await wait_until(lambda: sum(r.chunks >= 3 and not r.done for r in results) >= STREAMS // 2, 60,
                     "half the streams to be mid-answer")
    held = await asyncio.to_thread(_leases_on, mesh, VICTIM)
    stopped_at = time.monotonic()
    os.kill(pid, signal.SIGSTOP)
    # The scheduler's side: its registration ends by keepalive too.
    dropped = asyncio.create_task(_dropped_after(mesh, stopped_at, bound + 30))
    try:
        # The gateway notices by keepalive alone and migrates the victim's streams.
        await eventually(lambda: gateway_counter(mesh, "kvmesh_gateway_migrations_total") > migrations,
                         bound + 30, "a stream to migrate off the silent engine")
        detected = time.monotonic() - stopped_at
        results = await _finish(tasks, session)
        completed = time.monotonic() - stopped_at
        _assert_same(results, expected)
        moved = gateway_counter(mesh, "kvmesh_gateway_migrations_total") - migrations
        dropped_after = await dropped
    finally:
        dropped.cancel()
        healed_at = time.monotonic()
        os.kill(pid, signal.SIGCONT)
    print(f"silent partition of {VICTIM} (SIGSTOP, {held} leases): first migration after {detected:.1f}s, "
          f"scheduler dropped it after {dropped_after:.1f}s (keepalive bound {bound:.0f}s), {STREAMS} streams "
          f"complete and identical, {moved:.0f} migrated, {completed:.1f}s SIGSTOP -> last token")
    assert moved >= 1 and detected <= bound + 10, f"detected after {detected:.1f}s, bound {bound}s"
    assert dropped_after <= bound + 10, f"the scheduler dropped {VICTIM} after {dropped_after:.1f}s"

    # Healed: it runs nothing (its orphans cancelled or fenced), rejoins, serves.
    def idle() -> bool:
        info = engine_infos(mesh)[0]
        return info.running == 0 and info.waiting == 0
    fence = mesh.config.fencing
    # Reconnect (backoff <= 2 s), rejoin grace, two reports a confirm period
    # apart: well inside this, and inside any resume grace of detached ones.
    await eventually(idle, 2 + fence.rejoin_grace_seconds + fence.confirm_seconds + 10,
                     f"{VICTIM} to hold no generation after the heal")
    orphans_gone = time.monotonic() - healed_at
    await _rejoined(mesh, VICTIM)
    fenced = await asyncio.to_thread(_engine_counter, mesh, 0, "kvmesh_engine_fenced_total")
    print(f"healed: {VICTIM} idle {orphans_gone:.1f}s after SIGCONT ({fenced:.0f} fenced, the rest "
          f"cancelled as their connections were gone), re-registered and fresh")
    # Nothing it held reached a client twice: the answers above are exact; a
    # second round, placed on both engines again, is exact too.
    _, again_tasks, again_session = await run_streams(mesh, prompts, lengths)
    _assert_same(await _finish(again_tasks, again_session), expected)
    assert mesh.exited() == []


async def test_a_generation_no_lease_covers_is_fenced(e2e_mesh: Mesh) -> None:
    """An engine runs a generation the scheduler leases to nobody (here: a
    caller that went to the engine directly, as a gateway whose request was
    migrated away and whose connection survived would): the scheduler fences
    it within the fencing bound, the engine ends it (its caller told
    UNAVAILABLE, never a cut answer) and counts it."""
    mesh = e2e_mesh
    fence = mesh.config.fencing
    before = await asyncio.to_thread(_engine_counter, mesh, 0, "kvmesh_engine_fenced_total")
    address = mesh.endpoints.engines[0]
    started = time.monotonic()
    async with grpc.aio.insecure_channel(address) as channel:
        call = engine_pb2_grpc.EngineStub(channel).Generate()
        await call.write(engine_pb2.EngineGenerateMessage(request=engine_pb2.EngineRequest(
            request_id="unleased-orphan", prompt_token_ids=list(range(100, 140)),
            sampling=common_pb2.SamplingParams(max_tokens=16_000, ignore_eos=True))))
        tokens = 0
        with pytest.raises(grpc.aio.AioRpcError) as ended:
            async with asyncio.timeout(fence.rejoin_grace_seconds + fence.confirm_seconds + 30):
                while (event := await call.read()) is not grpc.aio.EOF:
                    assert not event.HasField("finished"), "the orphan ran to its end: never fenced"
                    tokens += len(event.delta.token_ids)
    elapsed = time.monotonic() - started
    assert ended.value.code() == grpc.StatusCode.UNAVAILABLE and "fenced" in (ended.value.details() or "")
    assert tokens > 0
    fenced = await asyncio.to_thread(_engine_counter, mesh, 0, "kvmesh_engine_fenced_total")
    assert fenced == before + 1
    await eventually(lambda: engine_infos(mesh)[0].running == 0, 10, "the fenced generation to be gone")
    print(f"an unleased generation was fenced {elapsed:.1f}s after it started ({tokens} tokens generated)")
