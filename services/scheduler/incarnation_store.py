"""The incarnation fence's memory, kept outside the scheduler process, so a
scheduler restart does not forget which engine process is the newest of
its id (engine_registry.py has the rules).

Why this shape. An incarnation is chosen by the engine from its wall clock
(services/engine/scheduler_link.py `new_incarnation`), so any two of one
id compare without the scheduler having seen either: all the scheduler
has to keep is the greatest it accepted per id. It kept that in memory
only, so after a restart the first process of an id to say hello was
taken -- a stale one (the old process of a rescheduled engine, cut off by
a partition) as readily as the current one, and it got work until the
current one reconnected and superseded it. Now every hello first goes
through `IncarnationStore.remember`, which records the incarnation when it
is the greatest for its id and answers the greatest recorded; an older
hello is refused as superseded before the core sees it.

- The store only ever grows per id (a max), so its writes commute: any
  number of schedulers may share one store and an older process is
  refused by every one of them once any one accepted a newer process.
  That is what several active schedulers (issue 27) need, and why the
  store is shared, not per replica.
- `FileIncarnations`: a small JSON file (`scheduler.incarnations_file`,
  by default in the run directory), read-merged-written under an
  exclusive `flock`, replaced atomically: shared by every scheduler that
  names the same file (`kvmesh up`'s restarts, replicas on one host, a
  pod's container restarts on its volume). For schedulers on several
  hosts, the same record in a Redis (`scheduler.incarnations_redis_url`;
  incarnation_redis.py).
- The current engine is never refused: it is the newest process of its
  id, so nothing greater is recorded. An incarnation from a clock far in
  the future (`FUTURE_TOLERANCE_SECONDS`) is not recorded, so one
  misconfigured host cannot fence its id out for good across restarts
  (the registry still fences by it while this scheduler runs, as before).
- The store failing (unreadable file, full disk, a stalled volume: bounded
  by `TIMEOUT_SECONDS`) never refuses an engine: the hello goes on with
  the registry's in-memory fence alone, and the failure is logged.

Ownership: `remember` is called from the scheduler's event loop; the file
work runs in a worker thread, one group at a time per store (its writer
task), and the flock orders it against other processes. Cost, measured here
with 1,024 ids: 0.12 ms per hello that records nothing (a restart's
reconnects: the file is parsed once), 5.8 ms per group that records (the
write's fsync), whatever the group's size.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

__all__ = [
    "FUTURE_TOLERANCE_SECONDS", "FileIncarnations", "IncarnationStore", "MemoryIncarnations", "Newest",
    "incarnation_unix_seconds",
]

log = logging.getLogger(__name__)

# Low bits of an incarnation that are random (scheduler_link._INCARNATION_RANDOM_BITS).
_RANDOM_BITS = 22
# An incarnation whose clock reads more than this ahead of the scheduler's
# is not recorded (see the module docstring). 10 minutes: far beyond NTP's
# error, well short of a clock set wrong by hours or years.
FUTURE_TOLERANCE_SECONDS = 600.0
# Longest a hello waits for the store before going on without it.
TIMEOUT_SECONDS = 2.0


@dataclass(frozen=True)
class Newest:
    """The greatest incarnation recorded for an id, and its process's address."""

    incarnation: int
    address: str


class IncarnationStore(Protocol):
    async def remember(self, engine_id: str, incarnation: int, address: str) -> Newest:
        """Record (`incarnation`, `address`) for `engine_id` if it is the
        greatest; the greatest recorded after that. Never raises: a store
        that cannot answer answers the incoming one."""
        ...


def incarnation_unix_seconds(incarnation: int) -> float:
    """The wall-clock time an incarnation was chosen at."""
    return (incarnation >> _RANDOM_BITS) / 1000.0


def _recordable(incarnation: int, now_unix: float) -> bool:
    return incarnation > 0 and incarnation_unix_seconds(incarnation) <= now_unix + FUTURE_TOLERANCE_SECONDS


class MemoryIncarnations:
    """In this process only (a scheduler given no file, and tests)."""

    def __init__(self) -> None:
        self._newest: dict[str, Newest] = {}

    async def remember(self, engine_id: str, incarnation: int, address: str) -> Newest:
        known = self._newest.get(engine_id)
        if known is not None and known.incarnation >= incarnation:
            return known
        if _recordable(incarnation, time.time()):
            self._newest[engine_id] = Newest(incarnation, address)
        return Newest(incarnation, address)


class FileIncarnations:
    """A JSON file {engine id: [incarnation, address]} shared through the
    file system (see the module docstring).

    Hellos that arrive while the file is being written wait together and
    are answered by one read-merge-write (a group commit): a fleet that
    registers at once -- a scheduler's first start, a fleet restarted --
    costs a few writes, not one per engine. One write per hello made that
    O(engines^2) (each rewrites the whole table) and serial: 1,024 new
    engines took 4.0 s of the scheduler's CPU (in worker threads, holding
    the GIL against its event loop), the last one registered 4 s late."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)
        # Hellos waiting for the next group, and the task writing groups (None: idle).
        self._pending: list[tuple[str, Newest, asyncio.Future[Newest | Exception]]] = []
        self._writer: asyncio.Task[None] | None = None
        self.groups = 0   # groups written (tests, and the cost figure above)
        # The table as last read, and the file's (inode, size, mtime) then:
        # after a restart every engine says hello at once, and a file that
        # did not change since need not be parsed again for each.
        self._table: dict[str, Newest] = {}
        self._seen: tuple[int, int, int] | None = None

    async def remember(self, engine_id: str, incarnation: int, address: str) -> Newest:
        incoming = Newest(incarnation, address)
        if incarnation <= 0:
            return incoming
        answer: asyncio.Future[Newest | Exception] = asyncio.get_running_loop().create_future()
        self._pending.append((engine_id, incoming, answer))
        if self._writer is None:
            self._writer = asyncio.create_task(self._write_groups(), name="incarnations")
        # The group goes on without a hello that stopped waiting: its answer
        # is recorded all the same, for the next hello of its id.
        done, _ = await asyncio.wait({answer}, timeout=TIMEOUT_SECONDS)
        result: Newest | Exception = answer.result() if done else TimeoutError(f"no answer in {TIMEOUT_SECONDS} s")
        if isinstance(result, Newest):
            return result
        log.warning("engine incarnations at %s unavailable (%s: %s); engine %s is checked against this "
                    "scheduler's memory only", self.path, type(result).__name__, result, engine_id)
        return incoming

    async def _write_groups(self) -> None:
        """Answer what waits, a group at a time, until nothing does."""
        try:
            while self._pending:
                group, self._pending = self._pending, []
                try:
                    answers: list[Newest | Exception] = list(
                        await asyncio.to_thread(self._remember_all, [(e, n) for e, n, _ in group], time.time()))
                except (OSError, ValueError) as exc:
                    answers = [exc] * len(group)
                self.groups += 1
                for (_, _, future), answer in zip(group, answers, strict=True):
                    if not future.done():
                        future.set_result(answer)
        finally:
            self._writer = None

    def _remember_all(self, group: list[tuple[str, Newest]], now_unix: float) -> list[Newest]:
        """One locked read-merge-write for `group`, in order (two hellos of
        one id in it compare as if one after the other)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path.with_name(self.path.name + ".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)   # released when the file closes
            table = self._read()   # a copy of `_table`, the file as read
            answers = [self._merge(table, engine_id, incoming, now_unix) for engine_id, incoming in group]
            if table != self._table:
                self._write(table)
            return answers

    @staticmethod
    def _merge(table: dict[str, Newest], engine_id: str, incoming: Newest, now_unix: float) -> Newest:
        known = table.get(engine_id)
        if known is not None and known.incarnation >= incoming.incarnation:
            return known
        if _recordable(incoming.incarnation, now_unix):
            table[engine_id] = incoming
        else:
            log.warning("engine %s: incarnation %d is from a clock %.0f s ahead of this scheduler's; not "
                        "recorded", engine_id, incoming.incarnation,
                        incarnation_unix_seconds(incoming.incarnation) - now_unix)
        return incoming

    def _read(self) -> dict[str, Newest]:
        try:
            stat = self.path.stat()
        except FileNotFoundError:
            return {}
        seen = (stat.st_ino, stat.st_size, stat.st_mtime_ns)
        if seen != self._seen:
            raw = json.loads(self.path.read_text())
            if not isinstance(raw, dict):
                raise ValueError(f"{self.path}: expected a JSON object")
            self._table = {str(k): Newest(int(v[0]), str(v[1])) for k, v in raw.items()}
            self._seen = seen
        return dict(self._table)

    def _write(self, table: dict[str, Newest]) -> None:
        staging = self.path.with_name(self.path.name + ".tmp")
        with open(staging, "w") as out:
            json.dump({k: [v.incarnation, v.address] for k, v in sorted(table.items())}, out)
            out.flush()
            os.fsync(out.fileno())
        os.replace(staging, self.path)
        self._seen = None   # read it back next time: cheap, and never trusts a stale stat
        with contextlib.suppress(OSError):   # the rename's own durability: best effort
            directory = os.open(self.path.parent, os.O_RDONLY)
            try:
                os.fsync(directory)
            finally:
                os.close(directory)
