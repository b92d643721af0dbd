"""The incarnation fence survives a restart of the real scheduler process:
`kvmesh scheduler` records engine incarnations in <run_dir> by default
(services/scheduler/incarnation_store.py), so SIGKILLed and started again
it still refuses the older process of an engine id that reconnects first,
and takes the current one. Written against the scheduler's wire protocol
only, so it runs (and fails) on a scheduler without the record too."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import yaml

from services.common.config import MeshConfig
from services.common.grpc_server import client_options
from services.common.proto.kvmesh.v1 import scheduler_pb2 as pb
from services.common.proto.kvmesh.v1 import scheduler_pb2_grpc
from services.engine.scheduler_link import new_incarnation, superseded_by
from services.launcher.ports import PortAllocator

from .test_engine_identity import _hello
from .test_grpc import TIMEOUT, wait_state

ROOT = Path(__file__).resolve().parents[3]


async def _registered(stub: scheduler_pb2_grpc.SchedulerStub, address: str, incarnation: int):
    call = stub.Connect(timeout=TIMEOUT * 3)
    await call.write(_hello(address, incarnation))
    await call.write(pb.EngineMessage(load=pb.LoadReport(serving=True, blocks_total=1000)))
    await wait_state(stub, lambda s: [(e.address, e.incarnation) for e in s.engines] == [(address, incarnation)])
    return call


def _process_config(tmp_path: Path) -> tuple[Path, int]:
    port = PortAllocator().one()
    config = MeshConfig(run_dir=str(tmp_path / "run"))
    config.scheduler.port, config.scheduler.metrics_port = port, 0
    path = tmp_path / "kvmesh.yaml"
    path.write_text(yaml.safe_dump(dataclasses.asdict(config), sort_keys=False))
    return path, port


def _start(path: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "services.cli", "--config", str(path), "scheduler"],
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


async def _ended(call) -> grpc.aio.AioRpcError:
    while True:
        try:
            await call.read()
        except grpc.aio.AioRpcError as ended:
            return ended


async def _ending(call, stub: scheduler_pb2_grpc.SchedulerStub, address: str) -> grpc.aio.AioRpcError | str:
    """How the stream of the process at `address` ended -- or that the
    scheduler registered it."""
    ending = asyncio.create_task(_ended(call))
    async with asyncio.timeout(TIMEOUT):
        while not ending.done():
            state = await stub.GetState(pb.GetStateRequest(), timeout=TIMEOUT)
            taken = [f"{e.engine_id} at {e.address} (incarnation {e.incarnation})" for e in state.engines
                     if e.address == address]
            if taken:
                ending.cancel()
                return f"registered: {taken[0]}"
            await asyncio.sleep(0.02)
    return ending.result()


@contextlib.asynccontextmanager
async def _channel(port: int) -> AsyncIterator[scheduler_pb2_grpc.SchedulerStub]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=client_options()) as channel:
        await asyncio.wait_for(channel.channel_ready(), 30)
        yield scheduler_pb2_grpc.SchedulerStub(channel)


async def test_the_scheduler_process_keeps_the_fence_across_a_sigkill(tmp_path: Path) -> None:
    path, port = _process_config(tmp_path)
    old, new = new_incarnation(), new_incarnation() + (1 << 22)   # the old process started first
    process = _start(path)
    try:
        async with _channel(port) as stub:
            call = await _registered(stub, "new:1", new)
            call.cancel()
        process.send_signal(signal.SIGKILL)
        process.wait(10)
        process = _start(path)
        async with _channel(port) as stub:
            stale = stub.Connect(timeout=TIMEOUT * 3)
            await stale.write(_hello("old:1", old))
            with contextlib.suppress(grpc.aio.AioRpcError, grpc.aio.UsageError):   # refused at once: fine
                await stale.write(pb.EngineMessage(load=pb.LoadReport(serving=True, blocks_total=1000)))
            refused = await _ending(stale, stub, "old:1")
            assert isinstance(refused, grpc.aio.AioRpcError), f"the stale process was taken: {refused}"
            assert refused.code() == grpc.StatusCode.FAILED_PRECONDITION and superseded_by(refused) == "new:1"
            call = await _registered(stub, "new:1", new)
            call.cancel()
    finally:
        process.kill()
        process.wait(10)
