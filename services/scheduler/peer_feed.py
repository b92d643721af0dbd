"""This replica's queue heads, streamed to the replicas that watch them
(`Scheduler.WatchQueueHeads`; peer_heads.py says what they do with them).

A watcher gets the heads at once, then again whenever they change -- at most
once per `publish_interval_seconds`, so a replica placing hundreds of
requests a second sends each watcher a bounded stream -- and at least every
`heartbeat_seconds`, so it can tell a quiet replica from a silent one.
Nothing is computed while no replica watches.

Owned by the scheduler servicer (grpc_api.py); `refresh` runs after each
event the core handled, on the event loop's thread, like everything else.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

from services.common.config.peers import PeersConfig
from services.common.proto.kvmesh.v1 import scheduler_pb2

from .peer_heads import QueueHead

__all__ = ["QueueHeadsFeed"]


class QueueHeadsFeed:
    def __init__(self, replica: str, config: PeersConfig, heads: Callable[[], list[QueueHead]]) -> None:
        self._replica = replica
        self._interval = config.publish_interval_seconds
        self._heartbeat = config.heartbeat_seconds
        self._heads = heads
        self._last: tuple[QueueHead, ...] = ()
        self._watchers: set[asyncio.Event] = set()

    def refresh(self) -> None:
        """Look at the heads again (after an event); wake the watchers if they changed."""
        if not self._watchers:
            return
        heads = tuple(self._heads())
        if heads != self._last:
            self._last = heads
            for changed in self._watchers:
                changed.set()

    async def watch(self) -> AsyncIterator[scheduler_pb2.QueueHeads]:
        """The messages of one watcher's stream, until it goes."""
        changed = asyncio.Event()
        self._watchers.add(changed)
        try:
            self._last = tuple(self._heads())
            while True:
                changed.clear()
                yield self._message()
                await asyncio.sleep(self._interval)
                if not changed.is_set():
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(changed.wait(), self._heartbeat)
        finally:
            self._watchers.discard(changed)

    def _message(self) -> scheduler_pb2.QueueHeads:
        return scheduler_pb2.QueueHeads(replica=self._replica, heads=[
            scheduler_pb2.QueueHead(model=h.model, priority=h.priority, request_id=h.request_id)
            for h in self._last])
