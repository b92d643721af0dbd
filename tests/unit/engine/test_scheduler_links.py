"""An engine with several scheduler replicas (services/engine/
scheduler_links.py, fencing.py): one Connect stream to each, the same hello
(one incarnation) and reports to all; a generation that starts is reported
to every replica at once, not at the next periodic report; each replica's
report lists only its own generations (the others are counted) and tells it
the prompts the others placed here (as prefix hashes), and a fence
ends only a generation of the replica that sent it -- one of a replica that
is gone only after the grace, once every connected replica fenced it."""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import cast

import grpc
import pytest
from engine_helpers import engine_config, mesh_config, prompt_of
from test_scheduler_link import FakeScheduler

from services.common.config import FencingConfig
from services.common.prefix_hash import block_hashes
from services.common.proto.kvmesh.v1 import common_pb2, engine_pb2, engine_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from services.common.scheduler_replica import REPLICA_METADATA_KEY
from services.engine.fencing import Fencer
from services.engine.runtime import EngineRuntime
from services.engine.server import EngineService


class NamedScheduler(FakeScheduler):
    """A replica that names itself on the Connect stream, as the real one does."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    async def Connect(self, request_iterator, context):  # noqa: N802 - the proto's method name
        await context.send_initial_metadata(((REPLICA_METADATA_KEY, self.name),))
        async for command in super().Connect(request_iterator, context):
            yield command

    def drain(self) -> None:
        while not self.messages.empty():
            self.messages.get_nowait()


@dataclass
class Replicas:
    svc: EngineService
    fakes: list[NamedScheduler]
    servers: list[grpc.aio.Server] = field(default_factory=list)


async def _serve(fake: NamedScheduler) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(fake, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


@pytest.fixture
async def replicas() -> AsyncIterator[Replicas]:
    fakes = [NamedScheduler("sched-a"), NamedScheduler("sched-b")]
    served = [await _serve(f) for f in fakes]
    engine = engine_config(scheduler_addresses=[address for _, address in served])
    engine.sim.speed_factor = 0.05  # ~0.4 ms per step: a long stream stays visible
    config = mesh_config()
    config.fencing.startup_grace_seconds = 0.3
    svc = EngineService(config, engine)
    await svc.start()
    try:
        yield Replicas(svc, fakes, [s for s, _ in served])
    finally:
        await svc.stop()
        for server, _ in served:
            await server.stop(0)


async def _named(r: Replicas) -> None:
    """Every link knows its replica's name (from the stream's metadata)."""
    assert r.svc.links is not None
    async with asyncio.timeout(5):
        while [link.replica for link in r.svc.links.links] != ["sched-a", "sched-b"]:
            await asyncio.sleep(0.01)


async def _open(svc: EngineService, rid: str, owner: str, tokens: int = 8) -> grpc.aio.StreamStreamCall:
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{svc.port}")
    call = engine_pb2_grpc.EngineStub(channel).Generate()
    await call.write(engine_pb2.EngineGenerateMessage(request=engine_pb2.EngineRequest(
        request_id=rid, prompt_token_ids=prompt_of(tokens, start=700), scheduler_replica=owner,
        sampling=common_pb2.SamplingParams(max_tokens=4000))))
    return call


async def test_every_replica_gets_the_same_hello_snapshot_and_reports(replicas: Replicas) -> None:
    hellos = [(await f.next("hello")).hello for f in replicas.fakes]
    assert hellos[0] == hellos[1] and hellos[0].incarnation > 0   # one process, one incarnation
    for fake in replicas.fakes:
        await fake.next("kv_snapshot")
        assert (await fake.next("load")).load.serving


async def test_a_new_generation_is_reported_to_every_replica_at_once(replicas: Replicas) -> None:
    """Measured: the report leaves without waiting for the periodic one (here
    set to 30 s): each replica learns of the other's placement in about a
    millisecond of the engine."""
    svc = replicas.svc
    await _named(replicas)
    assert svc.links is not None
    for link in svc.links.links:
        link.min_report_gap = link._interval = link.heartbeat = 30.0
    await asyncio.sleep(0.2)                   # the writers now wait out the long gap
    for fake in replicas.fakes:
        fake.drain()
    loop = asyncio.get_running_loop()
    began = loop.time()
    call = await _open(svc, "placed-by-a", "sched-a")
    try:
        a = (await replicas.fakes[0].next("load", timeout=1.0)).load
        b = (await replicas.fakes[1].next("load", timeout=1.0)).load
        took = loop.time() - began
        print(f"a new generation reached both replicas' reports {took * 1000:.1f} ms after its request "
              "was sent (periodic reports: every 30 s here)")
        assert took < 0.1, f"reports took {took * 1000:.1f} ms"
        assert list(a.request_ids) == ["placed-by-a"] and a.other_replica_generations == 0
        assert list(b.request_ids) == [] and b.other_replica_generations == 1
    finally:
        call.cancel()


async def test_the_other_replicas_hear_the_prompt_placed_here(replicas: Replicas) -> None:
    """The report that tells replica B of A's new generation carries its
    prompt's prefix hashes (the gateway's and the KV events' hash space), so
    B counts the placement in its in-flight prefixes and live set; A, which
    placed it, is not told."""
    svc = replicas.svc
    await _named(replicas)
    assert svc.links is not None
    for link in svc.links.links:
        link.min_report_gap = link._interval = link.heartbeat = 30.0
    await asyncio.sleep(0.2)
    for fake in replicas.fakes:
        fake.drain()
    call = await _open(svc, "placed-by-a", "sched-a", tokens=40)   # 2 full blocks of 16
    try:
        a = (await replicas.fakes[0].next("load", timeout=1.0)).load
        b = (await replicas.fakes[1].next("load", timeout=1.0)).load
        assert list(a.placed_elsewhere) == []
        assert [list(p.prefix_hashes) for p in b.placed_elsewhere] == [block_hashes(prompt_of(40, start=700), 16)]
        assert svc.links.links[1]._placed_elsewhere == deque()   # told once
    finally:
        call.cancel()


async def test_with_one_scheduler_a_new_generation_waits_for_the_report_gap() -> None:
    """One address: reports go out as they always did (rate-limited)."""
    fake = NamedScheduler("only")
    server, address = await _serve(fake)
    svc = EngineService(mesh_config(), engine_config(scheduler_address=address))
    await svc.start()
    try:
        link = svc.link
        assert link is not None
        async with asyncio.timeout(5):
            while link.replica != "only":
                await asyncio.sleep(0.01)
        link.min_report_gap = link._interval = link.heartbeat = 30.0
        await asyncio.sleep(0.2)
        fake.drain()
        call = await _open(svc, "r1", "only")
        with pytest.raises(TimeoutError):
            await fake.next("load", timeout=0.3)
        call.cancel()
    finally:
        await svc.stop()
        await server.stop(0)


async def _fence(fake: NamedScheduler, rid: str) -> None:
    await fake.commands.put(scheduler_pb2.SchedulerCommand(fence=scheduler_pb2.Fence(request_ids=[rid])))


async def _live(svc: EngineService, rid: str, live: bool = True) -> None:
    """Wait until generation `rid` is live here (or, `live` False, gone)."""
    async with asyncio.timeout(5):
        while (svc.runtime.live(rid) is not None) != live:
            await asyncio.sleep(0.01)


@contextlib.asynccontextmanager
async def _running(r: Replicas, rid: str) -> AsyncIterator[EngineService]:
    """A generation `rid` that replica "sched-a" leased, live on the engine."""
    await _named(r)
    call = await _open(r.svc, rid, "sched-a")
    try:
        await _live(r.svc, rid)
        yield r.svc
    finally:
        call.cancel()


async def test_only_the_owning_replica_fences(replicas: Replicas) -> None:
    async with _running(replicas, "owned") as svc:
        await _fence(replicas.fakes[1], "owned")      # B never leased it
        await asyncio.sleep(0.3)
        assert svc.runtime.live("owned") is not None
        await _fence(replicas.fakes[0], "owned")      # its own replica
        await _live(svc, "owned", live=False)
        assert svc.links is not None and svc.links.fencer.fenced == 1


async def test_a_gone_replicas_generation_is_fenced_only_after_the_grace(replicas: Replicas) -> None:
    async with _running(replicas, "orphan") as svc:
        await replicas.servers[0].stop(0)             # replica A is gone
        assert svc.links is not None
        async with asyncio.timeout(5):
            while svc.links.links[0].connected.is_set():
                await asyncio.sleep(0.01)
        # Now listed to B (it may take the lease over), not yet fenced by it.
        async with asyncio.timeout(5):
            while "orphan" not in (await replicas.fakes[1].next("load")).load.request_ids:
                pass
        await _fence(replicas.fakes[1], "orphan")
        await asyncio.sleep(0.1)
        assert svc.runtime.live("orphan") is not None  # within the grace (0.3 s)
        await asyncio.sleep(0.3)
        await _fence(replicas.fakes[1], "orphan")      # past it, and every connected replica agrees
        await _live(svc, "orphan", live=False)


# ------------------------------------------------------------------ the Fencer alone


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def monotonic(self) -> float:
        return self.now


def _fencer(owners: dict[str, str]) -> tuple[Fencer, _Clock, list[str]]:
    ended: list[str] = []
    clock = _Clock()

    def generation(rid: str) -> object | None:
        if rid not in owners or rid in ended:
            return None
        return SimpleNamespace(request=SimpleNamespace(scheduler_replica=owners[rid]),
                               hand_over=lambda _msg: ended.append(rid))

    counter = SimpleNamespace(inc=lambda _n=1: None)
    runtime = SimpleNamespace(generation=generation, clock=clock,
                              metrics=SimpleNamespace(fenced=SimpleNamespace(labels=lambda _e: counter)))
    fencer = Fencer(cast(EngineRuntime, runtime), "e", FencingConfig(confirm_seconds=1.0, startup_grace_seconds=10.0))
    return fencer, clock, ended


def test_listing_and_fences_follow_the_owner() -> None:
    fencer, _clock, ended = _fencer({"a1": "A", "b1": "B", "x": ""})
    # No replica named yet (one scheduler, or before its metadata): everything, as always.
    assert fencer.listed_to(["a1", "b1", "x"], "") == (["a1", "b1", "x"], 0)
    fencer.replica_up("A")
    fencer.replica_up("B")
    assert fencer.listed_to(["a1", "b1", "x"], "A") == (["a1", "x"], 1)
    assert fencer.listed_to(["a1", "b1", "x"], "B") == (["b1", "x"], 1)
    assert fencer.apply(["a1", "b1"], "B") == 1 and ended == ["b1"]      # only B's own
    assert fencer.apply(["x"], "A") == 1                                  # no owner: anyone's fence
    assert fencer.apply(["a1"], "") == 1                                  # an unnamed scheduler: today's rule


def test_a_gone_owner_needs_the_grace_and_every_connected_replica() -> None:
    fencer, clock, ended = _fencer({"g": "A"})
    for name in ("A", "B", "C"):
        fencer.replica_up(name)
    fencer.replica_down("A")                       # A died; its gateway re-attaches g on B or C
    assert fencer.listed_to(["g"], "B") == (["g"], 0)
    clock.now += 5
    assert fencer.apply(["g"], "C") == 0           # within the grace
    clock.now += 6
    assert fencer.apply(["g"], "C") == 0           # past it, but B (which may hold the lease) did not fence
    assert fencer.apply(["g"], "B") == 1 and ended == ["g"]


def test_a_restarted_replica_does_not_end_what_another_took_over() -> None:
    """A restarts under a new name (A2) while B holds the re-attached lease:
    A2 fences g on every report, B never does, so g keeps running."""
    fencer, clock, ended = _fencer({"g": "A"})
    fencer.replica_up("A")
    fencer.replica_up("B")
    fencer.replica_down("A")
    fencer.replica_up("A2")
    for _ in range(10):
        clock.now += 2
        assert fencer.apply(["g"], "A2") == 0
    assert ended == []
