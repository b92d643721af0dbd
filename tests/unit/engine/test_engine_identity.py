"""An engine process superseded by a newer one of its id (a rescheduled
pod) stops: over a real in-process scheduler and two sim engines with one
id. The newer is registered at once; the older's live generation ends
UNAVAILABLE (the gateway migrates it), its runtime fails (the process exits
for its supervisor) and its link does not reconnect. The announced address
is `advertise_address` when set -- a DNS name is kept as sent."""

from __future__ import annotations

import asyncio
import socket

import grpc
from engine_helpers import engine_stub, mesh_config, started
from test_engine_failure import ending, open_stream, sim_engine

from services.common.proto.kvmesh.v1 import scheduler_pb2, scheduler_pb2_grpc
from services.engine.scheduler_link import SUPERSEDED_METADATA_KEY, superseded_by
from services.engine.server import EngineService
from services.scheduler.server import SchedulerService

TIMEOUT = 10.0


async def _state(port: int) -> scheduler_pb2.SchedulerState:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        return await scheduler_pb2_grpc.SchedulerStub(channel).GetState(
            scheduler_pb2.GetStateRequest(), timeout=TIMEOUT)


async def _until(port: int, predicate) -> scheduler_pb2.SchedulerState:
    deadline = asyncio.get_running_loop().time() + TIMEOUT
    while True:
        state = await _state(port)
        if predicate(state):
            return state
        assert asyncio.get_running_loop().time() < deadline, f"never matched: {state}"
        await asyncio.sleep(0.02)


async def test_a_newer_process_of_the_id_takes_over_and_the_old_one_stops() -> None:
    config = mesh_config()
    config.scheduler.metrics_port = 0
    scheduler = SchedulerService(config)
    port = await scheduler.start(port=0)
    address = f"127.0.0.1:{port}"
    try:
        old = EngineService(config, sim_engine(engine_id="eng-x", scheduler_address=address))
        async with started(old), engine_stub(old) as stub:
            await _until(port, lambda s: len(s.engines) == 1)
            assert old.link is not None
            call = await open_stream(stub, "r-old")
            name = "localhost:59999"   # a DNS name, announced as is
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                http_port = s.getsockname()[1]
            new = EngineService(config, sim_engine(engine_id="eng-x", scheduler_address=address,
                                                   advertise_address=name, http_port=http_port))
            async with started(new):
                state = await _until(port, lambda s: [e.address for e in s.engines] == [name])
                assert new.link is not None
                assert state.engines[0].incarnation == new.link.incarnation > old.link.incarnation
                # The HTTP endpoint is announced on the same name.
                assert new.link._hello().http_address == f"localhost:{http_port}"
                code, details, _ = await asyncio.wait_for(ending(call), TIMEOUT)
                assert code == grpc.StatusCode.UNAVAILABLE, details
                await asyncio.wait_for(old.runtime.died.wait(), TIMEOUT)
                assert old.link.superseded_by == name
                assert "superseded" in (old.runtime.dead or "")
                sessions = old.link.sessions
                await asyncio.sleep(0.5)   # no reconnect loop: it stays out
                assert old.link.sessions == sessions and not old.link.connected.is_set()
                assert [e.address for e in (await _state(port)).engines] == [name]
    finally:
        await scheduler.stop(grace=0.5)


def test_only_a_superseded_answer_stops_the_link() -> None:
    def error(code: grpc.StatusCode, *trailing: tuple[str, str]) -> grpc.aio.AioRpcError:
        return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(*trailing), "x")

    assert superseded_by(error(grpc.StatusCode.FAILED_PRECONDITION, (SUPERSEDED_METADATA_KEY, "b:1"))) == "b:1"
    # A protocol complaint, a duplicate id of an older engine, an outage: retried as before.
    assert superseded_by(error(grpc.StatusCode.FAILED_PRECONDITION)) is None
    assert superseded_by(error(grpc.StatusCode.ALREADY_EXISTS, (SUPERSEDED_METADATA_KEY, "b:1"))) is None
    assert superseded_by(error(grpc.StatusCode.UNAVAILABLE)) is None
    assert superseded_by(RuntimeError("x")) is None
