"""Watching the other scheduler replicas' queue heads
(`Scheduler.WatchQueueHeads` on each of `scheduler.peers.addresses`) and
handing them to the core as `PeerHeadsHeard` events (peer_heads.py).

One task per address, for the life of the process: it reconnects after a
failure (0.2 s, doubling to 2 s: a restarted replica listens again within
seconds) and gives up only on the address that turns out to be this replica
itself (FAILED_PRECONDITION: the list is every replica's, its own included).
A stream that ends, or stays silent past `stale_seconds` (a replica cut off
without a FIN: no heartbeat), is that replica gone: it holds nothing back
until it is heard again.

Owned by the scheduler servicer (grpc_api.py), on the event loop's thread.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TypeAlias, cast

import grpc

from services.common.config import MeshConfig
from services.common.grpc_server import client_options
from services.common.mesh_tls import aio_channel, identity_for
from services.common.proto.kvmesh.v1 import scheduler_pb2, scheduler_pb2_grpc

from . import events as ev
from .peer_heads import QueueHead

__all__ = ["PeerWatch"]

log = logging.getLogger(__name__)

_BACKOFF_FIRST, _BACKOFF_MAX = 0.2, 2.0

_WatchCall: TypeAlias = "grpc.aio.UnaryStreamCall[scheduler_pb2.WatchQueueHeadsRequest, scheduler_pb2.QueueHeads]"


class PeerWatch:
    def __init__(self, config: MeshConfig, replica: str, handle: Callable[[ev.PeerHeadsHeard], None]) -> None:
        self._config = config
        self._peers = config.scheduler.peers
        self._replica = replica
        self._handle = handle
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._watch(address), name=f"peer-watch-{address}")
                       for address in self._peers.addresses]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=2.0)   # a watch's channel closing never holds up a stop
        self._tasks = []

    async def _watch(self, address: str) -> None:
        backoff = _BACKOFF_FIRST
        identity = identity_for(self._config, "scheduler")
        while True:
            heard: list[str] = []
            try:
                async with aio_channel(address, identity, "scheduler", client_options()) as channel:
                    call = scheduler_pb2_grpc.SchedulerStub(channel).WatchQueueHeads(
                        scheduler_pb2.WatchQueueHeadsRequest(replica=self._replica))
                    await self._read(call, heard)
            except grpc.aio.AioRpcError as err:
                if err.code() == grpc.StatusCode.FAILED_PRECONDITION:
                    log.info("scheduler peer %s is this replica; not watched", address)
                    return
                log.debug("scheduler peer %s: %s", address, err.code().name)
            except TimeoutError:
                log.warning("scheduler peer %s silent for %.1f s; reconnecting", address, self._peers.stale_seconds)
            finally:
                if heard:
                    self._handle(ev.PeerHeadsHeard(heard[0], None))
            backoff = _BACKOFF_FIRST if heard else min(_BACKOFF_MAX, backoff * 2)
            await asyncio.sleep(backoff)

    async def _read(self, call: _WatchCall, heard: list[str]) -> None:
        """Hand each message to the core until the stream ends; a silence
        past `stale_seconds` raises TimeoutError."""
        try:
            while True:
                # Not wait_for: cancelling it waits for the read's own
                # cancellation, which grpc.aio does not always finish (a stop
                # hung there); the call's cancel below ends the read instead.
                read = asyncio.ensure_future(call.read())
                read.add_done_callback(_consume)
                done, _ = await asyncio.wait({read}, timeout=self._peers.stale_seconds)
                if not done:
                    raise TimeoutError
                message = read.result()
                if message is grpc.aio.EOF:
                    return
                message = cast(scheduler_pb2.QueueHeads, message)
                if not heard:
                    heard.append(message.replica)
                self._handle(ev.PeerHeadsHeard(message.replica, tuple(
                    QueueHead(h.model, h.priority, h.request_id) for h in message.heads)))
        finally:
            call.cancel()


def _consume(read: asyncio.Future[object]) -> None:
    """A read ended by the call's cancel: its error is expected, not logged."""
    if not read.cancelled():
        read.exception()
