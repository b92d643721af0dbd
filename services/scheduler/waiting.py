"""The waiting side of the scheduler: per model, the class queues
(queue.py) and the Replace lane of requests that lost their engine and go
ahead of the queue.

Ownership rule: `WaitingRoom` is owned by `SchedulerCore` and called only
from it (so only from the core's one thread, see core.py). It keeps the
order of waiting requests and says who is next or past its time; the core
decides what happens to them (place, reject, finish).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass

from .aging import AgingRule
from .classes import ClassTable, PriorityClass
from .peer_heads import QueueHead
from .queue import ModelQueue, Promotion
from .queue_policies import FairnessPolicy, OrderingPolicy
from .records import NUM_CLASSES, QueueEntry, RequestRecord

__all__ = ["Expired", "QueueStat", "WaitingRoom"]


@dataclass(frozen=True)
class QueueStat:
    """One (class, tenant) queue as GetState shows it."""

    priority: int
    tenant: str
    queued: int
    oldest_wait_seconds: float
    # The queue's class: the ladder class of `priority`, or a class off the
    # ladder (classes.py) shown as a row apart.
    klass: PriorityClass


@dataclass
class Expired:
    """What one pass of time did to the waiting requests."""

    promotions: list[Promotion]
    entries: list[QueueEntry]               # past their class TTL in a queue
    replacements: list[RequestRecord]       # past their deadline in a Replace lane


class WaitingRoom:
    def __init__(self, aging: AgingRule, fairness: FairnessPolicy, ordering: OrderingPolicy,
                 classes: ClassTable | None = None) -> None:
        self._aging = aging
        self._classes = classes
        self._fairness = fairness
        self._ordering = ordering
        self._queues: dict[str, ModelQueue] = {}
        self._lanes: dict[str, OrderedDict[str, RequestRecord]] = {}
        # Classes nothing is dispatched from (kvmesh.v1.Admin PauseClass;
        # queue.py's rules); changed only by the core's admin knobs.
        self.paused: set[int] = set()

    def idle(self) -> bool:
        """Nothing queued and no replacement waiting: a dispatch has nothing
        to age, expire or place (the engines' reports, most events at fleet
        scale, then cost no pass over the queues)."""
        return not any(map(len, self._queues.values())) and not any(self._lanes.values())

    def replacing(self) -> bool:
        """A replacement waits (in some model's lane)."""
        return any(self._lanes.values())

    def models(self) -> list[str]:
        """Models with a queue or a lane (possibly empty until `drop_empty`)."""
        return list(self._lanes.keys() | self._queues.keys())

    def queue(self, model: str) -> ModelQueue:
        """The model's queue, created on first use."""
        queue = self._queues.get(model)
        if queue is None:
            queue = self._queues[model] = ModelQueue(
                self._aging, self._fairness, self._ordering, self.paused, self._classes)
        return queue

    def existing_queue(self, model: str) -> ModelQueue | None:
        return self._queues.get(model)

    def lane(self, model: str) -> OrderedDict[str, RequestRecord] | None:
        return self._lanes.get(model)

    def add_replacement(self, rec: RequestRecord) -> None:
        self._lanes.setdefault(rec.options.model, OrderedDict())[rec.options.request_id] = rec

    def remove(self, rec: RequestRecord, queued: bool) -> None:
        """Take the request out of its queue (when `queued`) and its lane."""
        request_id = rec.options.request_id
        if queued:
            queue = self._queues.get(rec.options.model)
            if queue is not None:
                queue.remove(request_id)
        lane = self._lanes.get(rec.options.model)
        if lane is not None:
            lane.pop(request_id, None)

    def advance(self, now: float) -> Expired:
        """Apply aging and find everything past its time (still in place;
        the core rejects them)."""
        expired = Expired([], [], [])
        for queue in self._queues.values():
            promotions, entries = queue.advance(now)
            expired.promotions.extend(promotions)
            expired.entries.extend(entries)
        for lane in self._lanes.values():
            expired.replacements.extend(r for r in lane.values() if r.replace_expires_at <= now)
        return expired

    def drop_empty(self) -> None:
        for model in [m for m, q in self._queues.items() if len(q) == 0]:
            del self._queues[model]
        for model in [m for m, lane in self._lanes.items() if not lane]:
            del self._lanes[model]

    def class_len(self, cls: int) -> int:
        return sum(q.class_len(cls) for q in self._queues.values())

    def apart_len(self, klass: PriorityClass) -> int:
        """Requests of `klass`, a class off the ladder, queued, all models
        (its own cap's count: CapScope.OWN)."""
        return sum(q.apart_len(klass) for q in self._queues.values())

    def tenant_len(self, tenant: str) -> int:
        return sum(q.tenant_len(tenant) for q in self._queues.values())

    def displaceable(self, tenant: str, above: int) -> QueueEntry | None:
        """The tenant's newest queued request of its lowest class below class
        `above` (numerically greater), or None: what admission displaces for
        a newcomer of class `above`. Only the ladder is searched: a class off
        it counts in no tenant's cap. O(models x classes x log n)."""
        for cls in range(NUM_CLASSES - 1, above, -1):
            found = [e for q in self._queues.values() if (e := q.classes[cls].newest(tenant))]
            if found:
                return max(found, key=lambda e: e.seq)
        return None

    def heads(self) -> list[QueueHead]:
        """Per model with a request waiting, the one that leaves next (its
        class rank with aging applied): what the other replicas are told
        (peer_heads.py). Replace lanes are left out: nothing is held for them."""
        heads = []
        for model, queue in self._queues.items():
            entry = queue.peek()
            if entry is not None:
                heads.append(QueueHead(model, entry.cls, entry.request_id))
        return heads

    def queued_total(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def positions(self) -> Iterator[tuple[QueueEntry, int]]:
        for queue in self._queues.values():
            yield from queue.positions()

    def stats(self, now: float) -> list[QueueStat]:
        """One row per (queue class, tenant), the ladder's rows first."""
        stats: dict[tuple[bool, int, str, PriorityClass], tuple[int, float]] = {}
        ladder = ClassTable.ladder()
        for queue in self._queues.values():
            rows = [*((ladder[q.cls], q) for q in queue.classes), *queue.apart.items()]
            for klass, cls_queue in rows:
                apart = cls_queue not in queue.classes
                for tenant, entries in cls_queue.tenant_entries():
                    key = (apart, cls_queue.cls, tenant, klass)
                    count, oldest = stats.get(key, (0, 0.0))
                    wait = max(now - min(e.arrival for e in entries), 0.0)
                    stats[key] = (count + len(entries), max(oldest, wait))
        return [QueueStat(c, t, n, w, k) for (_, c, t, k), (n, w) in
                sorted(stats.items(), key=lambda item: item[0][:3])]
