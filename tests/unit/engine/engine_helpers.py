"""Shared helpers for the engine's unit tests: a free-running sim (speed 0)
and a synchronous driver for SimCore."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from services.common.config import EngineConfig, MeshConfig
from services.common.proto.kvmesh.v1 import engine_pb2_grpc
from services.engine.backend import GenerationOutput, GenerationRequest, Sampling
from services.engine.model import SyntheticCodec
from services.engine.server import EngineService
from services.engine.sim.core import CoreLimits, SimCore, SimRequest
from services.engine.sim.text import TokenPicker


def mesh_config() -> MeshConfig:
    return MeshConfig()  # no models: the sim serves "sim" with synthetic text


def engine_config(**overrides: object) -> EngineConfig:
    engine = EngineConfig(port=0, scheduler_address="", total_blocks=256, max_running=8,
                          report_interval_seconds=0.05, stop_grace_seconds=0.0)
    engine.sim.speed_factor = 0.0
    for key, value in overrides.items():
        setattr(engine, key, value)
    return engine


@contextlib.asynccontextmanager
async def started(svc: EngineService) -> AsyncIterator[EngineService]:
    """The engine service running in-process until the block ends."""
    await svc.start()
    try:
        yield svc
    finally:
        await svc.stop()


@contextlib.asynccontextmanager
async def engine_stub(svc: EngineService) -> AsyncIterator[engine_pb2_grpc.EngineStub]:
    """A client of the running service's gRPC API."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{svc.port}") as channel:
        yield engine_pb2_grpc.EngineStub(channel)


def make_core(block_size: int = 16, total_blocks: int = 64, max_running: int = 8,
              chunk_tokens: int = 512) -> SimCore:
    codec = SyntheticCodec(32000)
    limits = CoreLimits(block_size=block_size, total_blocks=total_blocks, max_running=max_running,
                        hash_block_tokens=16, chunk_tokens=chunk_tokens)
    return SimCore(limits, TokenPicker(codec.clean_token_ids, codec.eos_token_id, 0.0),
                   codec.token_text, codec.eos_token_id)


def request(rid: str, prompt: list[int], max_tokens: int = 8, priority: int = 1,
            **sampling: Any) -> GenerationRequest:
    return GenerationRequest(rid, list(prompt), Sampling(max_tokens=max_tokens, **sampling),
                             priority=priority)


def run_core(core: SimCore, until: Callable[[], bool] | None = None, max_steps: int = 10_000) -> int:
    """Step the core synchronously; returns the steps taken."""
    for step in range(max_steps):
        if until is not None and until():
            return step
        if not core.has_work():
            return step
        core.apply(core.schedule())
    raise AssertionError("the core did not settle")


async def drain_sink(req: SimRequest) -> GenerationOutput:
    """Everything the request produced so far, merged (it must be finished)."""
    out = await asyncio.wait_for(req.sink.next(), 1)
    return out


def prompt_of(n: int, start: int = 300) -> list[int]:
    return [start + (i * 7) % 900 for i in range(n)]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class RecordingListener:
    """A KvListener that replays events into a set, like the scheduler's index."""

    def __init__(self) -> None:
        self.held: set[int] = set()
        self.stored_count = 0
        self.removed_count = 0

    def stored(self, hashes: list[int]) -> None:
        self.stored_count += len(hashes)
        self.held.update(hashes)

    def removed(self, hashes: list[int]) -> None:
        self.removed_count += len(hashes)
        self.held.difference_update(hashes)

    def cleared(self) -> None:
        self.held.clear()
