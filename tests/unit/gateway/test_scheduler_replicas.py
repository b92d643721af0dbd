"""Several scheduler replicas seen from the gateway (services/gateway/
scheduler_replicas.py): each request is admitted on the replica its id
ranks first (rendezvous hashing) among the reachable ones, and moves to
another when its replica goes away -- queued: admitted again with its
arrival time; running: its lease re-attached (`running_on_engine`) -- and
a replica back from a restart is passed over until its engines report to
it."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
import openai
import pytest
from conftest import KEY_FULL, MODEL, FakeScheduler, Mesh, _serve, open_mesh
from openai.types.chat import ChatCompletionMessageParam
from test_gateway_restart import ReattachingScheduler

from services.common.config import MeshConfig
from services.common.proto.kvmesh.v1 import scheduler_pb2, scheduler_pb2_grpc
from services.gateway import replica_warmup
from services.gateway.scheduler_replicas import SchedulerReplicas, rendezvous_order

CHAT: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hello world"}]


def test_rendezvous_is_stable_spread_and_moves_only_the_lost_replicas_ids() -> None:
    addresses = ["10.0.0.1:50051", "10.0.0.2:50051", "10.0.0.3:50051"]
    ids = [f"req-{i}" for i in range(600)]
    first = {i: rendezvous_order(i, addresses)[0] for i in ids}
    assert first == {i: rendezvous_order(i, list(reversed(addresses)))[0] for i in ids}  # order-free
    counts = {a: sum(1 for f in first.values() if f == a) for a in addresses}
    assert all(150 <= n <= 250 for n in counts.values()), counts
    # Without replica 1, only its requests move (to their second choice).
    survivors = [addresses[0], addresses[2]]
    for i in ids:
        now = rendezvous_order(i, survivors)[0]
        assert now == (first[i] if first[i] != addresses[1] else rendezvous_order(i, addresses)[1])


async def _scheduler(servicer: FakeScheduler) -> tuple[grpc.aio.Server, str]:
    return await _serve(scheduler_pb2_grpc.add_SchedulerServicer_to_server, servicer)


def _request(request_id: str) -> scheduler_pb2.AdmitRequest:
    return scheduler_pb2.AdmitRequest(request_id=request_id, model=MODEL, tenant="t", prompt_tokens=4,
                                      max_tokens=4)


async def test_admits_spread_by_rendezvous_and_skip_an_unreachable_replica() -> None:
    fakes = [FakeScheduler(), FakeScheduler()]
    for fake in fakes:
        fake.engines = {"engine-a": "127.0.0.1:1"}
    served = [await _scheduler(f) for f in fakes]
    addresses = [address for _, address in served]
    replicas = SchedulerReplicas(addresses)
    try:
        while not all(replicas.healthy(a) for a in addresses):
            await asyncio.sleep(0.01)
        ids = [f"r{i}" for i in range(40)]
        for request_id in ids:
            session = await replicas.open(_request(request_id))
            assert isinstance(await session.next_outcome(), scheduler_pb2.Queued)
            session.cancel()
        for fake, address in zip(fakes, addresses, strict=True):
            mine = [i for i in ids if rendezvous_order(i, addresses)[0] == address]
            assert [a.request.request_id for a in fake.admits] == mine and mine  # each got its share
        # Replica 0 goes away: once its channel says so, its requests open on
        # replica 1 (no backoff, no error). A request opened in between finds
        # out on its first read: LeaseLink moves it (the tests below).
        await served[0][0].stop(0)
        async with asyncio.timeout(2):
            while replicas.healthy(addresses[0]):
                await asyncio.sleep(0.005)
        moved = [i for i in ids if rendezvous_order(i, addresses)[0] == addresses[0]]
        before = len(fakes[1].admits)
        async with asyncio.timeout(5):
            for request_id in moved[:5]:
                session = await replicas.open(_request(request_id))
                assert isinstance(await session.next_outcome(), scheduler_pb2.Queued)
                session.cancel()
        assert [a.request.request_id for a in fakes[1].admits[before:]] == moved[:5]
        assert not replicas.healthy(addresses[0]) and replicas.is_ready()
    finally:
        await replicas.close()
        for server, _ in served:
            await server.stop(0)


@contextlib.asynccontextmanager
async def _two_replicas(model_dir: Path, second: FakeScheduler) -> AsyncIterator[tuple[Mesh, str]]:
    """The gateway mesh of conftest with a second scheduler replica."""
    server, address = await _scheduler(second)

    def tune(config: MeshConfig) -> None:
        config.gateway.scheduler_addresses = [config.gateway.scheduler_address, address]

    try:
        async with open_mesh(model_dir, tune) as mesh:
            second.engines = mesh.scheduler.engines     # the same fleet
            yield mesh, address
    finally:
        await server.stop(0)


def _owned_by_first(mesh: Mesh, second: str) -> str:
    """A chat request id whose rendezvous owner is the conftest scheduler."""
    first = mesh.config.gateway.scheduler_address
    return next(f"own-{i}" for i in range(100) if rendezvous_order(f"own-{i}", [first, second])[0] == first)


async def test_queued_request_moves_to_the_other_replica_keeping_its_arrival(model_dir: Path) -> None:
    other = FakeScheduler()
    async with _two_replicas(model_dir, other) as (mesh, address):
        mesh.scheduler.queue_hold = asyncio.Event()       # never placed by its first replica
        request_id = _owned_by_first(mesh, address)
        async with openai.AsyncOpenAI(base_url=f"{mesh.http}/v1", api_key=KEY_FULL, max_retries=0,
                                      timeout=30) as c:
            request = asyncio.create_task(c.chat.completions.create(
                model=MODEL, messages=CHAT, extra_headers={"x-request-id": request_id}))
            async with asyncio.timeout(10):
                while not mesh.scheduler.admits:
                    await asyncio.sleep(0.02)
            await asyncio.sleep(0.1)                       # the gateway has read its queue place
            await mesh.servers[0].stop(0)                  # its replica dies; the other is up
            out = await asyncio.wait_for(request, 10)
    assert out.usage.completion_tokens == 6
    assert [a.request.request_id for a in other.admits] == [request_id]
    again = other.admits[0].request
    assert again.arrival_unix == mesh.scheduler.admits[0].request.arrival_unix and not again.running_on_engine


async def test_running_request_reattaches_on_the_other_replica(model_dir: Path) -> None:
    other = ReattachingScheduler()
    async with _two_replicas(model_dir, other) as (mesh, address):
        engine = mesh.engines["engine-a"]
        engine.answer_tokens, engine.token_delay = 40, 0.03
        request_id = _owned_by_first(mesh, address)
        async with openai.AsyncOpenAI(base_url=f"{mesh.http}/v1", api_key=KEY_FULL, max_retries=0,
                                      timeout=30) as c:
            stream = await c.chat.completions.create(model=MODEL, messages=CHAT, stream=True, max_tokens=40,
                                                     extra_headers={"x-request-id": request_id})
            text, killed = "", False
            async for chunk in stream:
                if chunk.choices:
                    text += chunk.choices[0].delta.content or ""
                if not killed and text:
                    killed = True
                    await mesh.servers[0].stop(0)         # its replica dies mid-stream
        async with asyncio.timeout(10):
            while not (other.admits and other.admits[-1].done is not None):
                await asyncio.sleep(0.02)
    assert len(engine.requests) == 1                       # never interrupted
    again = other.admits[-1]
    assert again.request.request_id == request_id and again.request.running_on_engine == "engine-a"
    assert again.messages == ["first_token", "done"]


async def test_a_replica_shutting_down_hands_its_queued_request_to_the_other(model_dir: Path) -> None:
    """A rolling restart: the stopping replica answers DRAINING; with another
    replica up the request moves there instead of failing (alone: 503)."""
    other = FakeScheduler()
    async with _two_replicas(model_dir, other) as (mesh, address):
        mesh.scheduler.reject = scheduler_pb2.Rejected(code=scheduler_pb2.REJECT_CODE_DRAINING,
                                                       message="shutting down", retry_after_seconds=1)
        request_id = _owned_by_first(mesh, address)
        async with openai.AsyncOpenAI(base_url=f"{mesh.http}/v1", api_key=KEY_FULL, max_retries=0,
                                      timeout=30) as c:
            out = await c.chat.completions.create(model=MODEL, messages=CHAT,
                                                  extra_headers={"x-request-id": request_id})
    assert out.usage.completion_tokens == 6
    assert [a.request.request_id for a in mesh.scheduler.admits] == [request_id]
    assert [a.request.request_id for a in other.admits] == [request_id]


async def test_one_replica_shutting_down_still_answers_503(model_dir: Path) -> None:
    async with open_mesh(model_dir) as mesh:
        mesh.scheduler.reject = scheduler_pb2.Rejected(code=scheduler_pb2.REJECT_CODE_DRAINING,
                                                       message="shutting down", retry_after_seconds=1)
        async with openai.AsyncOpenAI(base_url=f"{mesh.http}/v1", api_key=KEY_FULL, max_retries=0,
                                      timeout=30) as c:
            with pytest.raises(openai.APIStatusError) as refused:
                await c.chat.completions.create(model=MODEL, messages=CHAT)
    assert refused.value.status_code == 503


@pytest.mark.parametrize("addresses", [["a:1"], ["a:1", "b:2", "c:3"]])
def test_one_request_always_ranks_the_same(addresses: list[str]) -> None:
    assert len({tuple(rendezvous_order("same-id", addresses)) for _ in range(5)}) == 1


class _Fleet(FakeScheduler):
    """A replica whose GetState lists `fresh` engines with a fresh report."""

    def __init__(self, fresh: int) -> None:
        super().__init__()
        self.fresh = fresh

    async def GetState(self, request: scheduler_pb2.GetStateRequest,  # noqa: N802 - the proto's method name
                       context: grpc.aio.ServicerContext) -> scheduler_pb2.SchedulerState:
        return scheduler_pb2.SchedulerState(engines=[
            scheduler_pb2.EngineState(engine_id=f"engine-{i}", model=MODEL, serving=True, fresh=True)
            for i in range(self.fresh)])


async def _serve_on(servicer: FakeScheduler, address: str) -> grpc.aio.Server:
    server = grpc.aio.server()
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(servicer, server)
    server.add_insecure_port(address)
    await server.start()
    return server


async def _until(predicate: Callable[[], bool], seconds: float = 5.0) -> None:
    async with asyncio.timeout(seconds):
        while not predicate():
            await asyncio.sleep(0.01)


async def test_a_replica_back_from_a_restart_is_passed_over_until_its_engines_report_to_it() -> None:
    """A restarted replica listens before its engines reconnect (their
    backoff, up to 2 s): requests it would own go to a replica with the
    fleet meanwhile, instead of waiting there for engines."""
    first, second = _Fleet(2), _Fleet(2)
    server0, address0 = await _scheduler(first)
    server1, address1 = await _scheduler(second)
    replicas = SchedulerReplicas([address0, address1])
    replicas.start()
    try:
        await _until(lambda: replicas.healthy(address0) and replicas.healthy(address1))
        await server1.stop(0)                          # replica 1 dies ...
        await _until(lambda: not replicas.client(address1).is_ready())
        restarted = _Fleet(0)                          # ... and comes back with no engine yet
        server1 = await _serve_on(restarted, address1)
        await _until(lambda: replicas.client(address1).is_ready())
        await asyncio.sleep(0.3)                       # several warm-up looks
        assert not replicas.healthy(address1) and replicas.healthy(address0)
        mine = next(f"r{i}" for i in range(100) if rendezvous_order(f"r{i}", [address0, address1])[0] == address1)
        assert replicas.ranked(mine) == [address0, address1]
        restarted.fresh = 1                            # one engine back: still not the whole fleet
        await asyncio.sleep(0.3)
        assert not replicas.healthy(address1)
        restarted.fresh = 2
        await _until(lambda: replicas.healthy(address1))
        assert replicas.ranked(mine) == [address1, address0]
    finally:
        await replicas.close()
        await server0.stop(0)
        await server1.stop(0)


@dataclass
class _OneGone:
    """Two replicas, both healthy, then replica 1's server stopped and seen
    gone; `come_back` serves it again on its address with `fleet`."""
    replicas: SchedulerReplicas
    address0: str
    address1: str
    servers: list[grpc.aio.Server]

    async def come_back(self, fleet: FakeScheduler) -> None:
        self.servers.append(await _serve_on(fleet, self.address1))


@contextlib.asynccontextmanager
async def _second_replica_gone() -> AsyncIterator[_OneGone]:
    server0, address0 = await _scheduler(_Fleet(2))
    server1, address1 = await _scheduler(_Fleet(2))
    replicas = SchedulerReplicas([address0, address1])
    replicas.start()
    gone = _OneGone(replicas, address0, address1, [server0])
    try:
        await _until(lambda: replicas.healthy(address0) and replicas.healthy(address1))
        await server1.stop(0)
        await _until(lambda: not replicas.client(address1).is_ready())
        # Seen gone by its follow task too (on a loaded machine a moment later
        # than here): from then on its return is held back.
        await _until(lambda: replicas._replicas[address1].warmup.warming)
        yield gone
    finally:
        await replicas.close()
        await server1.stop(0)
        for server in gone.servers:
            await server.stop(0)


async def test_a_replica_that_never_gets_the_whole_fleet_is_used_after_the_bound(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(replica_warmup, "WARMUP_MAX_SECONDS", 1.0)
    async with _second_replica_gone() as gone:
        replicas, address1 = gone.replicas, gone.address1
        await gone.come_back(_Fleet(1))                 # one engine never reconnects to it
        await _until(lambda: replicas.client(address1).is_ready())
        back = asyncio.get_running_loop().time()
        await _until(lambda: replicas.healthy(address1), 5.0)
        assert asyncio.get_running_loop().time() - back >= 0.8


async def test_one_replica_is_not_followed() -> None:
    server, address = await _scheduler(_Fleet(0))
    replicas = SchedulerReplicas([address])
    replicas.start()
    try:
        assert replicas._warmups == []
    finally:
        await replicas.close()
        await server.stop(0)


async def test_a_replica_seen_gone_is_held_back_from_the_moment_it_returns() -> None:
    """Warming starts when the replica is seen gone, not when its return is
    noticed: a request that finds the channel READY again first is not
    admitted there before the engines report to it."""
    async with _second_replica_gone() as gone:
        replicas, address1 = gone.replicas, gone.address1
        await asyncio.sleep(0.05)
        assert replicas._replicas[address1].warmup.warming   # held back while gone already
        await gone.come_back(_Fleet(0))
        # From the first READY on (whether or not its follow task ran yet): not healthy.
        async with asyncio.timeout(5):
            while not replicas.client(address1).is_ready():
                assert not replicas.healthy(address1)
                await asyncio.sleep(0)
        assert not replicas.healthy(address1)
