"""The engine's Connect stream against an in-process fake Scheduler."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp
import grpc
import pytest
from engine_helpers import engine_config, free_port, mesh_config, prompt_of

from services.common.prefix_hash import block_hashes
from services.common.proto.kvmesh.v1 import common_pb2, engine_pb2, engine_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from services.common.scheduler_replica import KV_IN_REPORTS_METADATA_KEY
from services.engine.server import EngineService


class FakeScheduler(scheduler_pb2_grpc.SchedulerServicer):
    """Records every EngineMessage; `send` pushes a command to the engine."""

    def __init__(self) -> None:
        self.messages: asyncio.Queue[scheduler_pb2.EngineMessage] = asyncio.Queue()
        self.commands: asyncio.Queue[scheduler_pb2.SchedulerCommand] = asyncio.Queue()

    async def Connect(self, request_iterator, context):  # noqa: N802 - the proto's method name
        async def pump() -> None:
            async for message in request_iterator:
                await self.messages.put(message)

        reader = asyncio.create_task(pump())
        try:
            while not reader.done():
                getter = asyncio.create_task(self.commands.get())
                done, _ = await asyncio.wait({getter, reader}, return_when=asyncio.FIRST_COMPLETED)
                if getter in done:
                    yield getter.result()
                else:
                    getter.cancel()
        finally:
            reader.cancel()

    def drain_messages(self) -> None:
        """Forget what was received so far."""
        while not self.messages.empty():
            self.messages.get_nowait()

    async def next(self, kind: str, timeout: float = 5.0) -> scheduler_pb2.EngineMessage:
        """The next message of `kind`, skipping others (loads are frequent)."""
        async with asyncio.timeout(timeout):
            while True:
                message = await self.messages.get()
                if message.WhichOneof("msg") == kind:
                    return message


async def start_fake(port: int = 0) -> tuple[grpc.aio.Server, FakeScheduler, int]:
    fake = FakeScheduler()
    server = grpc.aio.server()
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(fake, server)
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server, fake, bound


@pytest.fixture
async def mesh() -> AsyncIterator[tuple[EngineService, FakeScheduler, grpc.aio.Server]]:
    server, fake, port = await start_fake()
    engine = engine_config(scheduler_address=f"127.0.0.1:{port}", weight=2.0)
    engine.sim.speed_factor = 0.05  # ~0.4 ms per step: a long stream stays visible
    svc = EngineService(mesh_config(), engine)
    await svc.start()
    try:
        yield svc, fake, server
    finally:
        await svc.stop()
        await server.stop(0)


async def generate(svc: EngineService, rid: str, prompt: list[int], max_tokens: int) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{svc.port}") as channel:
        call = engine_pb2_grpc.EngineStub(channel).Generate()
        await call.write(engine_pb2.EngineGenerateMessage(request=engine_pb2.EngineRequest(
            request_id=rid, prompt_token_ids=prompt, sampling=common_pb2.SamplingParams(max_tokens=max_tokens))))
        while True:
            event = await call.read()
            if event is grpc.aio.EOF or event.HasField("finished"):
                return


async def test_hello_snapshot_then_loads(mesh) -> None:
    svc, fake, _ = mesh
    first = await fake.messages.get()
    hello = first.hello
    assert first.WhichOneof("msg") == "hello"
    assert hello.engine_id == "engine-0" and hello.address == f"127.0.0.1:{svc.port}"
    assert hello.block_size == 16 and hello.total_blocks == 256 and hello.max_running == 8
    assert hello.hash_block_tokens == 16 and hello.backend == "sim" and hello.weight == 2.0
    assert hello.max_model_len > 0
    second = await fake.messages.get()
    assert second.WhichOneof("msg") == "kv_snapshot" and list(second.kv_snapshot.hashes) == []
    load = (await fake.next("load")).load
    assert load.serving and load.blocks_total == 256


async def a_long_request_is_listed(svc: EngineService, fake: FakeScheduler) -> None:
    """Start a long generation, wait until a load report lists its id, end it."""
    task = asyncio.create_task(generate(svc, "long", prompt_of(8, start=900), 4000))
    try:
        async with asyncio.timeout(5):
            while "long" not in (await fake.next("load")).load.request_ids:
                pass
    finally:
        await svc.runtime.abort("long")
        await task


async def test_kv_events_follow_the_snapshot_seq_and_resync(mesh) -> None:
    svc, fake, _ = mesh
    snapshot = (await fake.next("kv_snapshot")).kv_snapshot
    prompt = prompt_of(64)
    await generate(svc, "a", prompt, 4)
    events = (await fake.next("kv_events")).kv_events
    assert events.seq == snapshot.seq + 1
    assert list(events.stored) == block_hashes(prompt, 16)[: len(events.stored)]
    # A load report lists what is running: run something long, look for its id.
    await a_long_request_is_listed(svc, fake)
    await fake.commands.put(scheduler_pb2.SchedulerCommand(resync=scheduler_pb2.Resync()))
    fresh = (await fake.next("kv_snapshot")).kv_snapshot
    assert set(block_hashes(prompt, 16)) <= set(fresh.hashes)
    assert set(fresh.hashes) == set(svc.backend.kv_snapshot())
    await generate(svc, "b", prompt_of(48, start=2000), 2)
    later = (await fake.next("kv_events")).kv_events
    assert later.seq == fresh.seq + 1


async def test_drain_refuses_new_generations(mesh) -> None:
    svc, fake, _ = mesh
    await fake.next("kv_snapshot")
    await fake.commands.put(scheduler_pb2.SchedulerCommand(drain=scheduler_pb2.Drain()))
    async with asyncio.timeout(5):
        while (await fake.next("load")).load.serving:
            pass
    assert svc.runtime.draining


async def test_drain_with_hand_over_moves_running_generations_and_undrain_serves_again(mesh) -> None:
    """The operator's `kvmesh admin drain-engine --move`: the running
    generation ends UNAVAILABLE (its gateway continues it elsewhere), the
    engine reports not serving; Undrain makes it serve again."""
    svc, fake, _ = mesh
    await fake.next("kv_snapshot")
    async with grpc.aio.insecure_channel(f"127.0.0.1:{svc.port}") as channel:
        call = engine_pb2_grpc.EngineStub(channel).Generate()
        await call.write(engine_pb2.EngineGenerateMessage(request=engine_pb2.EngineRequest(
            request_id="long", prompt_token_ids=prompt_of(8, start=900),
            sampling=common_pb2.SamplingParams(max_tokens=4000))))
        assert (await call.read()).HasField("delta")
        await fake.commands.put(scheduler_pb2.SchedulerCommand(drain=scheduler_pb2.Drain(hand_over=True)))
        with pytest.raises(grpc.aio.AioRpcError) as ended:
            async with asyncio.timeout(5):
                while (event := await call.read()) is not grpc.aio.EOF:
                    assert not event.HasField("finished"), "a handed-over generation must not finish here"
        assert ended.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "drained by an operator" in (ended.value.details() or "")
    async with asyncio.timeout(5):
        while (load := (await fake.next("load")).load).serving or load.request_ids:
            pass
    assert svc.runtime.draining
    await fake.commands.put(scheduler_pb2.SchedulerCommand(undrain=scheduler_pb2.Undrain()))
    async with asyncio.timeout(5):
        while not (await fake.next("load")).load.serving:
            pass
    assert not svc.runtime.draining
    await generate(svc, "after", prompt_of(8, start=950), 2)


async def test_reconnects_after_the_scheduler_restarts(mesh) -> None:
    svc, fake, server = mesh
    await fake.next("kv_snapshot")
    await generate(svc, "a", prompt_of(40), 2)
    port = int(svc.engine.scheduler_address.rsplit(":", 1)[1])
    await server.stop(0)
    new_server, new_fake, _ = await start_fake(port)
    try:
        hello = await new_fake.next("hello", timeout=10)
        assert hello.hello.engine_id == "engine-0"
        snapshot = (await new_fake.next("kv_snapshot")).kv_snapshot
        assert set(snapshot.hashes) == set(svc.backend.kv_snapshot()) and snapshot.hashes
        assert svc.link is not None and svc.link.sessions >= 2
    finally:
        await new_server.stop(0)


async def test_a_fence_ends_the_named_generations_and_counts_them(mesh) -> None:
    """The scheduler leases "orphan" to no request here: it ends at once (its
    reader, if any, told UNAVAILABLE so it would migrate, never a cut answer);
    an id not live here is ignored."""
    svc, fake, _ = mesh
    await fake.next("kv_snapshot")
    async with grpc.aio.insecure_channel(f"127.0.0.1:{svc.port}") as channel:
        call = engine_pb2_grpc.EngineStub(channel).Generate()
        await call.write(engine_pb2.EngineGenerateMessage(request=engine_pb2.EngineRequest(
            request_id="orphan", prompt_token_ids=prompt_of(8, start=700),
            sampling=common_pb2.SamplingParams(max_tokens=4000))))
        async with asyncio.timeout(5):
            while "orphan" not in (await fake.next("load")).load.request_ids:
                pass
        await fake.commands.put(scheduler_pb2.SchedulerCommand(
            fence=scheduler_pb2.Fence(request_ids=["orphan", "never-here"])))
        with pytest.raises(grpc.aio.AioRpcError) as ended:
            async with asyncio.timeout(5):
                while (event := await call.read()) is not grpc.aio.EOF:
                    assert not event.HasField("finished"), "a fenced generation must not finish"
        assert ended.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "fenced" in (ended.value.details() or "")
    async with asyncio.timeout(5):
        while "orphan" in (await fake.next("load")).load.request_ids:
            pass
    assert svc.runtime.live_count == 0 and svc.backend.load().blocks_used == 0
    assert svc.link is not None and svc.link.fencer.fenced == 1
    assert b'kvmesh_engine_fenced_total{engine="engine-0"} 1.0' in svc.metrics.exposition()


async def test_unchanged_loads_go_out_only_as_heartbeats_and_changes_at_once(mesh) -> None:
    svc, fake, _ = mesh
    link = svc.link
    assert link is not None and link.heartbeat == 0.5  # stale_report_seconds 2.0 / 4 (> the 0.05 s interval)
    loop = asyncio.get_running_loop()
    first = (await fake.next("load")).load
    sent_at = loop.time()
    second = (await fake.next("load")).load
    # Idle: every 0.05 s report in between repeated the first, and was left out.
    # (The backend's progress count rides along; alone it changes no report.)
    second.backend_progress = first.backend_progress
    assert second == first and link.reports_skipped >= 3
    assert loop.time() - sent_at >= link.heartbeat / 2
    await a_long_request_is_listed(svc, fake)
    # The long request's outputs are the backend's progress: the next report says so.
    assert (await fake.next("load")).load.backend_progress > first.backend_progress


async def test_load_reports_leave_out_the_engines_own_endpoint_requests() -> None:
    """A request of the engine's own OpenAI endpoint (another router's) is
    leased by no scheduler: the report counts it as running but does not list
    its id, so the scheduler never fences it (listed, each was ended ~1-2 s
    after it started, finish_reason "abort")."""
    server, fake, port = await start_fake()
    engine = engine_config(scheduler_address=f"127.0.0.1:{port}", http_port=free_port())
    engine.sim.speed_factor = 0.05
    svc = EngineService(mesh_config(), engine)
    await svc.start()
    try:
        await fake.next("kv_snapshot")
        body = {"prompt": prompt_of(8, start=700), "max_tokens": 4000, "stream": True}
        async with aiohttp.ClientSession() as session:
            async with session.post(f"http://127.0.0.1:{engine.http_port}/v1/completions", json=body) as resp:
                await resp.content.readline()  # the stream is open: the generation is live
                async with asyncio.timeout(5):
                    while not (load := (await fake.next("load")).load).running:
                        pass
                assert svc.runtime.live_count == 1
                assert list(load.request_ids) == []
    finally:
        await svc.stop()
        await server.stop(0)


async def test_an_engine_that_stops_serving_says_so_without_waiting_out_the_report_gap(mesh) -> None:
    """A failed engine must stop getting placements before the gateways ask
    to replace its streams: `serving` false skips the rate limit."""
    svc, fake, _ = mesh
    link = svc.link
    assert link is not None
    assert (await fake.next("load")).load.serving
    link.min_report_gap = link._interval = 30.0  # no load would go out for 30 s
    await asyncio.sleep(0.1)  # the writer now waits out the long gap
    svc.runtime.fail("test: the core died")
    async with asyncio.timeout(2.0):
        while (await fake.next("load")).load.serving:
            pass


class KvReadingScheduler(FakeScheduler):
    """A scheduler that says it reads KV events inside load reports."""

    async def Connect(self, request_iterator, context):  # noqa: N802 - the proto's method name
        await context.send_initial_metadata(((KV_IN_REPORTS_METADATA_KEY, "1"),))
        async for command in super().Connect(request_iterator, context):
            yield command


async def test_kv_events_ride_in_load_reports_when_the_scheduler_reads_them_there() -> None:
    """A start's stored blocks and its load go in one message: the report
    carries the KV events, numbered on from the snapshot as KvEvents
    messages would be, and no KvEvents message goes out."""
    fake = KvReadingScheduler()
    server = grpc.aio.server()
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(fake, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    svc = EngineService(mesh_config(), engine_config(scheduler_address=f"127.0.0.1:{port}"))
    await svc.start()
    try:
        snapshot = (await fake.next("kv_snapshot")).kv_snapshot
        link = svc.link
        assert link is not None
        async with asyncio.timeout(5):
            while not link.kv_in_reports:   # the stream's initial metadata read
                await asyncio.sleep(0.01)
        fake.drain_messages()
        prompt = prompt_of(64)
        await generate(svc, "a", prompt, 4)
        stored: list[int] = []
        seqs: list[int] = []
        async with asyncio.timeout(5):
            while len(stored) < len(block_hashes(prompt, 16)):
                message = await fake.messages.get()
                assert message.WhichOneof("msg") == "load", "no KvEvents message once reports carry them"
                for kv in message.load.kv_events:
                    seqs.append(kv.seq)
                    stored.extend(kv.stored)
        assert seqs == list(range(snapshot.seq + 1, snapshot.seq + 1 + len(seqs)))
        assert stored[: len(block_hashes(prompt, 16))] == block_hashes(prompt, 16)
    finally:
        await svc.stop()
        await server.stop(0)
