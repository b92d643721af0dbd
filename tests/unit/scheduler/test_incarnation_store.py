"""The incarnation fence across scheduler restarts and replicas
(services/scheduler/incarnation_store.py): the greatest incarnation per
engine id is kept in a file every scheduler naming it shares, so a stale
engine process that reconnects first after a restart is refused; the
current process never is, and a store that fails refuses nobody. On the
store, then over gRPC with two schedulers in turn; with the real
`kvmesh scheduler` process (test_scheduler_restart_fence.py)."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from pathlib import Path

import grpc
import pytest

from services.common.clock import FakeClock
from services.common.config import MeshConfig
from services.common.grpc_server import client_options
from services.common.proto.kvmesh.v1 import scheduler_pb2 as pb
from services.common.proto.kvmesh.v1 import scheduler_pb2_grpc
from services.engine.scheduler_link import superseded_by
from services.scheduler import incarnation_store
from services.scheduler.incarnation_store import (
    FUTURE_TOLERANCE_SECONDS,
    FileIncarnations,
    MemoryIncarnations,
    Newest,
)
from services.scheduler.server import SchedulerService, incarnations_path

from .helpers import make_config
from .test_engine_identity import NEW, OLD, _hello, _refusal
from .test_grpc import TIMEOUT
from .test_scheduler_restart_fence import _registered

FUTURE = int((time.time() + 2 * FUTURE_TOLERANCE_SECONDS) * 1000) << 22


# ---------------------------------------------------------------- the store


async def test_the_file_keeps_the_greatest_per_id_for_every_scheduler_naming_it(tmp_path: Path) -> None:
    path = str(tmp_path / "incarnations.json")
    one, two = FileIncarnations(path), FileIncarnations(path)   # two replicas, or a restart
    assert await one.remember("e", NEW, "new:1") == Newest(NEW, "new:1")
    assert await two.remember("e", OLD, "old:1") == Newest(NEW, "new:1")        # never lowered
    assert await two.remember("e", NEW, "new:1") == Newest(NEW, "new:1")        # the current one
    assert await two.remember("f", OLD, "f:1") == Newest(OLD, "f:1")            # ids apart
    assert await FileIncarnations(path).remember("e", OLD, "old:1") == Newest(NEW, "new:1")
    assert await FileIncarnations(path).remember("f", 0, "f:2") == Newest(0, "f:2")   # none sent: no record


async def test_a_fleet_saying_hello_at_once_is_recorded_in_a_few_writes(tmp_path: Path) -> None:
    """A group commit: hellos that wait while the file is written are answered
    together (one write per hello made a fleet's registration O(engines^2) and
    serial: 4 s for 1,024 new engines)."""
    path = str(tmp_path / "incarnations.json")
    store = FileIncarnations(path)
    answers = await asyncio.gather(*(store.remember(f"e{i}", NEW, f"e{i}:1") for i in range(300)),
                                   store.remember("e7", OLD, "old:1"),     # older, same batch: refused
                                   store.remember("e8", NEW + 1, "newer:1"))   # newer, same batch: taken
    assert answers[:300] == [Newest(NEW, f"e{i}:1") for i in range(300)]
    assert answers[300] == Newest(NEW, "e7:1")
    assert answers[301] == Newest(NEW + 1, "newer:1")
    assert store.groups <= 3   # the first hello's own, then everything that queued behind it
    again = FileIncarnations(path)   # what the file holds: a restart's view
    assert await again.remember("e8", NEW, "e8:1") == Newest(NEW + 1, "newer:1")
    assert await again.remember("e299", OLD, "old:1") == Newest(NEW, "e299:1")


async def test_a_stalled_store_refuses_nobody_and_still_records(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(incarnation_store, "TIMEOUT_SECONDS", 0.2)
    store = FileIncarnations(str(tmp_path / "incarnations.json"))
    slow_write = store._remember_all

    def stalled(group: list[tuple[str, Newest]], now_unix: float) -> list[Newest]:
        time.sleep(0.6)   # a stalled volume
        return slow_write(group, now_unix)

    monkeypatch.setattr(store, "_remember_all", stalled)
    assert await store.remember("e", OLD, "old:1") == Newest(OLD, "old:1")   # went on without it
    while store.groups == 0:
        await asyncio.sleep(0.05)
    monkeypatch.setattr(store, "_remember_all", slow_write)
    assert await store.remember("e", OLD - 1, "older:1") == Newest(OLD, "old:1")   # recorded all the same


async def test_a_store_that_fails_refuses_nobody(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("")
    broken = FileIncarnations(str(tmp_path / "a-file" / "incarnations.json"))   # its folder is a file
    assert await broken.remember("e", OLD, "old:1") == Newest(OLD, "old:1")
    corrupt = tmp_path / "corrupt.json"
    corrupt.write_text("[1, 2")
    assert await FileIncarnations(str(corrupt)).remember("e", OLD, "old:1") == Newest(OLD, "old:1")


@pytest.mark.parametrize("store", ["memory", "file"])
async def test_a_clock_far_ahead_is_not_recorded(tmp_path: Path, store: str) -> None:
    """One host with its clock set wrong cannot fence its id out for good."""
    incarnations = MemoryIncarnations() if store == "memory" else FileIncarnations(str(tmp_path / "i.json"))
    assert await incarnations.remember("e", FUTURE, "wrong:1") == Newest(FUTURE, "wrong:1")   # taken, unrecorded
    assert await incarnations.remember("e", NEW, "new:1") == Newest(NEW, "new:1")


# ---------------------------------------------------------------- over gRPC, a restart


@dataclasses.dataclass
class _Scheduler:
    service: SchedulerService
    stub: scheduler_pb2_grpc.SchedulerStub
    channel: grpc.aio.Channel


async def _scheduler(path: str) -> _Scheduler:
    config = make_config(queued_update_seconds=0.1, tick_seconds=0.05)
    service = SchedulerService(config, clock=FakeClock(), incarnations=FileIncarnations(path))
    port = await service.start(port=0)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=client_options())
    return _Scheduler(service, scheduler_pb2_grpc.SchedulerStub(channel), channel)


async def _stop(scheduler: _Scheduler) -> None:
    await scheduler.channel.close()
    await scheduler.service.stop(grace=0.1)


async def test_a_restarted_scheduler_refuses_a_stale_engine_that_comes_back_first(tmp_path: Path) -> None:
    path = str(tmp_path / "incarnations.json")
    first = await _scheduler(path)
    try:
        new = await _registered(first.stub, "new:1", NEW)
        new.cancel()
    finally:
        await _stop(first)
    restarted = await _scheduler(path)   # nothing in its memory
    try:
        stale = restarted.stub.Connect(timeout=TIMEOUT * 3)
        await stale.write(_hello("old:1", OLD))          # the stale process reconnects first
        refused = await _refusal(stale)
        assert refused.code() == grpc.StatusCode.FAILED_PRECONDITION and superseded_by(refused) == "new:1"
        state = await restarted.stub.GetState(pb.GetStateRequest(), timeout=TIMEOUT)
        assert list(state.engines) == []
        current = await _registered(restarted.stub, "new:1", NEW)   # the current one is never refused
        current.cancel()
    finally:
        await _stop(restarted)


async def test_two_schedulers_naming_one_file_fence_for_each_other(tmp_path: Path) -> None:
    """Replicas (issue 27): the newer process registered at one, the older
    one is refused at the other, which never saw the newer."""
    path = str(tmp_path / "incarnations.json")
    one, two = await _scheduler(path), await _scheduler(path)
    try:
        new = await _registered(one.stub, "new:1", NEW)
        stale = two.stub.Connect(timeout=TIMEOUT * 3)
        await stale.write(_hello("old:1", OLD))
        assert superseded_by(await _refusal(stale)) == "new:1"
        new.cancel()
    finally:
        await _stop(one)
        await _stop(two)


def test_the_file_defaults_to_the_run_directory() -> None:
    config = MeshConfig(run_dir="/srv/run")
    assert incarnations_path(config) == "/srv/run/scheduler-incarnations.json"
    config.scheduler.incarnations_file = "/data/incarnations.json"
    assert incarnations_path(config) == "/data/incarnations.json"
