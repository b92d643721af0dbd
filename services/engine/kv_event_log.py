"""The engine's KV events waiting for the scheduler (one log per Connect
link, services/engine/scheduler_link.py): a KvListener collecting stored /
removed / cleared events into batches in which no hash is both stored and
removed (the batch is cut instead), so the scheduler may apply a message's
lists in any order. Past `MAX_PENDING_HASHES` waiting (a slow scheduler),
the log is dropped and marked `overflowed`: the link sends a snapshot in
its place, and memory stays bounded.

Ownership: the link that owns it; listeners append synchronously on the
event loop thread and set the link's wake event.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from services.common.proto.kvmesh.v1 import scheduler_pb2

__all__ = ["MAX_PENDING_HASHES", "KvEventLog"]

# Pending KV hashes beyond this are replaced by a snapshot (bounded memory).
MAX_PENDING_HASHES = 200_000


@dataclass
class _Batch:
    cleared: bool = False
    stored: list[int] = field(default_factory=list)
    removed: list[int] = field(default_factory=list)
    stored_set: set[int] = field(default_factory=set)
    removed_set: set[int] = field(default_factory=set)


class KvEventLog:
    """A KvListener collecting events into order-safe batches."""

    def __init__(self, wake: asyncio.Event) -> None:
        self._wake = wake
        self._batches: deque[_Batch] = deque()
        self._pending = 0
        self.overflowed = False

    def stored(self, hashes: list[int]) -> None:
        batch = self._open(lambda b: b.removed_set.isdisjoint(hashes))
        batch.stored.extend(hashes)
        batch.stored_set.update(hashes)
        self._added(len(hashes))

    def removed(self, hashes: list[int]) -> None:
        batch = self._open(lambda b: b.stored_set.isdisjoint(hashes))
        batch.removed.extend(hashes)
        batch.removed_set.update(hashes)
        self._added(len(hashes))

    def cleared(self) -> None:
        self._batches.clear()  # a clear supersedes everything before it
        self._batches.append(_Batch(cleared=True))
        self._added(0)

    def take(self) -> list[scheduler_pb2.KvEvents]:
        out = [scheduler_pb2.KvEvents(stored=b.stored, removed=b.removed, cleared=b.cleared)
               for b in self._batches]
        self.reset()
        return out

    def reset(self) -> None:
        self._batches.clear()
        self._pending = 0
        self.overflowed = False

    def __bool__(self) -> bool:
        return bool(self._batches)

    def _open(self, fits: Callable[[_Batch], bool]) -> _Batch:
        if not self._batches or not fits(self._batches[-1]):
            self._batches.append(_Batch())
        return self._batches[-1]

    def _added(self, count: int) -> None:
        self._pending += count
        if self._pending > MAX_PENDING_HASHES:
            self._batches.clear()
            self._pending = 0
            self.overflowed = True
        self._wake.set()
