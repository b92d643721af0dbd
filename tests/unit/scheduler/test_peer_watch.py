"""Scheduler replicas hearing each other's queue heads over real gRPC
(`Scheduler.WatchQueueHeads`; peer_feed.py, peer_watch.py): the list of
peers holds every replica, each finds itself and leaves itself out; a head
queued at one reaches the other; a stopped replica holds nothing back."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import grpc
import pytest

from services.common.clock import FakeClock
from services.common.grpc_server import client_options
from services.common.proto.kvmesh.v1 import scheduler_pb2 as pb
from services.common.proto.kvmesh.v1 import scheduler_pb2_grpc
from services.scheduler.events import RequestArrived
from services.scheduler.peer_heads import QueueHead
from services.scheduler.server import SchedulerService

from .helpers import make_config, opts

TIMEOUT = 10.0


async def _until(predicate: Callable[[], bool], what: str) -> None:
    deadline = asyncio.get_running_loop().time() + TIMEOUT
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"never: {what}")
        await asyncio.sleep(0.01)


async def test_replicas_hear_each_others_queue_heads() -> None:
    services = [SchedulerService(make_config(tick_seconds=0.05), clock=FakeClock()) for _ in range(2)]
    a, b = services
    ports = [await s.start(port=0) for s in services]
    try:
        addresses = [f"127.0.0.1:{port}" for port in ports]
        for service in services:   # known only now (port 0): the watch starts again with the list
            service.config.scheduler.peers.addresses = addresses
            service.servicer.peer_watch.start()
        b.servicer.deliver(b.core.handle(RequestArrived(opts("b-waits", priority=1))))   # no engine: it waits
        want = QueueHead("m", 1, "b-waits")
        await _until(lambda: a.core.peers.outranking("m", 2, 0.0) == (b.servicer.replica, want),
                     "A heard B's head")
        assert a.core.peers.outranking("m", 1, 0.0) is None     # a P1 is not outranked by a P1
        # Each replica's own address: answered FAILED_PRECONDITION, watched no more.
        for service in services:
            await _until(lambda s=service: sum(t.done() for t in s.servicer.peer_watch._tasks) == 1,  # type: ignore[misc]  # default-bound loop variable
                         "the watch of its own address ended")
        assert b.core.peers.fresh(0.0) == [a.servicer.replica]                     # B hears A (nothing waiting there)
        await b.stop(grace=0.2)
        await _until(lambda: a.core.peers.outranking("m", 2, 0.0) is None, "B gone holds nothing back")
    finally:
        for service in services:
            await service.stop(grace=0.2)


async def test_a_replica_does_not_watch_itself() -> None:
    service = SchedulerService(make_config(), clock=FakeClock())
    port = await service.start(port=0)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=client_options()) as channel:
            call = scheduler_pb2_grpc.SchedulerStub(channel).WatchQueueHeads(
                pb.WatchQueueHeadsRequest(replica=service.servicer.replica), timeout=TIMEOUT)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call.read()
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            # Another caller (an operator's grpcurl) gets the heads: none here.
            call = scheduler_pb2_grpc.SchedulerStub(channel).WatchQueueHeads(
                pb.WatchQueueHeadsRequest(replica="someone-else"), timeout=TIMEOUT)
            first = await call.read()
            assert first.replica == service.servicer.replica and list(first.heads) == []
            call.cancel()
    finally:
        await service.stop(grace=0.2)
