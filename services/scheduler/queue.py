"""Class queues for one model: priority classes, tenant fairness inside a
class, ordering inside a tenant, aging, TTL, and O(log n) removal.

Layout: class -> tenant -> a heap of entries by the ordering policy's key,
plus a heap by admission order (newest first) so admission can find a
tenant's newest request of a class to displace in O(log n).
Removal is lazy: a withdrawn or promoted entry is marked (`queued` false or
`cls` changed) and live counts are adjusted at once, so `remove` is O(1) and
stale heap items are skipped (amortised O(log n)) when they reach the top; a
heap is compacted when stale items outnumber live ones. Aging and expiry use
two more heaps keyed by time, advanced from the clock the caller passes.

Paused classes (the operator's kvmesh.v1.Admin PauseClass; the set is the
WaitingRoom's, shared): `peek` skips them, so nothing leaves a paused class,
and a promotion out of a paused class is held until the class is resumed,
then applied at once (aging catches up: the request takes the class its wait
gives it, as if there had been no pause). Promotions into a paused class go
on. TTL expiry goes on in every class.

The aging ladder (`ModelQueue.classes`, by rank) holds the classes that age
(classes.py, ClassRules.ages). A class off the ladder (batch lines) waits in
a queue of its own after it (`ModelQueue.apart`, at its rank, paused with
that rank): never promoted, left after every ladder request, and not
counted in `class_len` or `tenant_len` (it has a cap of its own).

Not thread-safe: owned by the scheduler core (see core.py).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Hashable, Iterator, Set
from dataclasses import dataclass, field

from services.common.config import SchedulerConfig

from .aging import AgingRule
from .classes import ClassTable, PriorityClass
from .queue_policies import FairnessPolicy, FairnessState, OrderingPolicy
from .records import NUM_CLASSES, QueueEntry

__all__ = ["ClassQueue", "ModelQueue", "Promotion"]

# Rebuild a heap once it holds this many more stale items than live ones.
_COMPACT_SLACK = 64


@dataclass
class _TenantHeap:
    items: list[tuple[tuple[Hashable, ...], int, QueueEntry]] = field(default_factory=list)
    live: int = 0
    # (-seq, entry): newest first; resumed (requeued) entries are left out.
    newest: list[tuple[int, QueueEntry]] = field(default_factory=list)


@dataclass(frozen=True)
class Promotion:
    entry: QueueEntry
    from_class: int
    to_class: int


class ClassQueue:
    """One priority class of one model: fair across tenants, ordered within."""

    def __init__(self, cls: int, fairness: FairnessPolicy, ordering: OrderingPolicy) -> None:
        self.cls = cls
        self._fairness = fairness
        self._ordering = ordering
        self._state = FairnessState()
        self._tenants: dict[str, _TenantHeap] = {}
        self.live = 0

    def _alive(self, entry: QueueEntry) -> bool:
        return entry.queued and entry.cls == self.cls

    def push(self, entry: QueueEntry) -> None:
        heap = self._tenants.get(entry.tenant)
        if heap is None:
            heap = self._tenants[entry.tenant] = _TenantHeap()
        heapq.heappush(heap.items, (self._ordering.key(entry), entry.seq, entry))
        if not entry.resumed:
            heapq.heappush(heap.newest, (-entry.seq, entry))
        heap.live += 1
        self.live += 1
        self._fairness.joined(self._state, entry.tenant)

    def discard(self, entry: QueueEntry) -> None:
        """Account for `entry` having left this class; the caller has already
        marked it (queued=False or a new cls). O(1)."""
        heap = self._tenants.get(entry.tenant)
        if heap is None or heap.live <= 0:
            raise RuntimeError(f"queue accounting broken for {entry.request_id}")
        heap.live -= 1
        self.live -= 1
        if heap.live == 0:
            del self._tenants[entry.tenant]
            self._fairness.left(self._state, entry.tenant)
        elif len(heap.items) > 2 * heap.live + _COMPACT_SLACK:
            heap.items = [item for item in heap.items if self._alive(item[2])]
            heapq.heapify(heap.items)
            heap.newest = [item for item in heap.newest if self._alive(item[1])]
            heapq.heapify(heap.newest)

    def _head(self, tenant: str) -> QueueEntry:
        heap = self._tenants[tenant]
        while not self._alive(heap.items[0][2]):
            heapq.heappop(heap.items)
        return heap.items[0][2]

    def newest(self, tenant: str) -> QueueEntry | None:
        """The tenant's most recently admitted entry here (not resumed ones),
        or None. Amortised O(log n): stale items are dropped on the way."""
        heap = self._tenants.get(tenant)
        if heap is None:
            return None
        while heap.newest and not self._alive(heap.newest[0][1]):
            heapq.heappop(heap.newest)
        return heap.newest[0][1] if heap.newest else None

    def peek(self) -> QueueEntry | None:
        tenant = self._fairness.next_tenant(self._state)
        return None if tenant is None else self._head(tenant)

    def pop(self, entry: QueueEntry) -> None:
        """Remove `entry`, which `peek` just returned, and give the turn on."""
        entry.queued = False
        heap = self._tenants[entry.tenant]
        heap.live -= 1
        self.live -= 1
        still = heap.live > 0
        if not still:
            del self._tenants[entry.tenant]
        self._fairness.served(self._state, entry.tenant, still)

    def tenant_entries(self) -> Iterator[tuple[str, list[QueueEntry]]]:
        """Each tenant's live entries in order, tenants in rotation order."""
        for tenant in self._fairness.rotation(self._state):
            heap = self._tenants[tenant]
            live = [item for item in heap.items if self._alive(item[2])]
            live.sort(key=lambda item: (item[0], item[1]))
            yield tenant, [item[2] for item in live]

    def tenant_count(self, tenant: str) -> int:
        heap = self._tenants.get(tenant)
        return heap.live if heap else 0

    def tenant_counts(self) -> dict[str, int]:
        return {tenant: heap.live for tenant, heap in self._tenants.items()}

    def estimate_position(self, tenant: str, rank: int) -> int:
        """Position in this class of the `rank`-th (0-based) request of
        `tenant` under round-robin rounds, from live counts only: O(tenants)."""
        position = 0
        rotation = self._fairness.rotation(self._state)
        before = True
        for other in rotation:
            count = self.tenant_count(other)
            if other == tenant:
                before = False
                continue
            position += min(count, rank + 1 if before else rank)
        return position


class ModelQueue:
    """All classes of one model, with aging and TTL."""

    def __init__(
        self, aging: AgingRule, fairness: FairnessPolicy, ordering: OrderingPolicy,
        paused: Set[int] = frozenset(), classes: ClassTable | None = None,
    ) -> None:
        self._aging = aging
        # Only the table's static columns are read here (ages, rank, cap scope).
        self._rules = classes if classes is not None else ClassTable.from_config(SchedulerConfig())
        self._paused = paused
        # Due promotions out of a paused class, by that class, until resumed.
        self._held: dict[int, list[tuple[float, int, int, QueueEntry]]] = {}
        self.classes = [ClassQueue(c, fairness, ordering) for c in range(NUM_CLASSES)]
        # Classes off the ladder: after it, fair across tenants among themselves.
        self.apart = {k: ClassQueue(r.rank, fairness, ordering) for k, r in self._rules.items() if not r.ages}
        self._in_order = [*self.classes, *self.apart.values()]
        self._entries: dict[str, QueueEntry] = {}
        self._promotions: list[tuple[float, int, int, QueueEntry]] = []
        self._expiries: list[tuple[float, int, QueueEntry]] = []
        self._tie = itertools.count()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._entries

    def get(self, request_id: str) -> QueueEntry | None:
        return self._entries.get(request_id)

    def _queue_of(self, entry: QueueEntry) -> ClassQueue:
        return self.classes[entry.cls] if self._rules[entry.klass].ages else self.apart[entry.klass]

    def push(self, entry: QueueEntry, now: float) -> list[Promotion]:
        """Queue `entry` in the class aging gives it at `now` (a re-admitted
        request may already be due for promotion). Returns the promotions
        applied, so the caller can count them. A class off the ladder is not aged."""
        if entry.request_id in self._entries:
            raise ValueError(f"request {entry.request_id} is already queued")
        self._entries[entry.request_id] = entry
        heapq.heappush(self._expiries, (entry.expires_at, next(self._tie), entry))
        if not self._rules[entry.klass].ages:
            entry.cls = entry.base_class
            self.apart[entry.klass].push(entry)
            return []
        target = self._aging.class_at(entry.base_class, entry.arrival, now)
        promotions = [
            Promotion(entry, c, c - 1) for c in range(entry.base_class, target, -1)
        ]
        entry.cls = target
        self.classes[target].push(entry)
        self._schedule_promotion(entry)
        return promotions

    def _schedule_promotion(self, entry: QueueEntry) -> None:
        at = self._aging.next_promotion(entry.base_class, entry.arrival, entry.cls)
        if at is not None:
            heapq.heappush(self._promotions, (at, next(self._tie), entry.cls, entry))

    def remove(self, request_id: str) -> QueueEntry | None:
        """Withdraw a request: O(1) (lazy in the heaps)."""
        entry = self._entries.pop(request_id, None)
        if entry is None:
            return None
        entry.queued = False
        self._queue_of(entry).discard(entry)
        return entry

    def advance(self, now: float) -> tuple[list[Promotion], list[QueueEntry]]:
        """Apply every promotion due by `now` and take out every entry whose
        TTL has passed. Returns (promotions, expired entries)."""
        for cls in [c for c in self._held if c not in self._paused]:
            for item in self._held.pop(cls):
                heapq.heappush(self._promotions, item)
        promotions: list[Promotion] = []
        while self._promotions and self._promotions[0][0] <= now:
            item = heapq.heappop(self._promotions)
            _, _, cls, entry = item
            if not entry.queued or entry.cls != cls:
                continue
            if cls in self._paused:
                self._held.setdefault(cls, []).append(item)
                continue
            entry.cls = cls - 1
            self.classes[cls].discard(entry)
            self.classes[cls - 1].push(entry)
            promotions.append(Promotion(entry, cls, cls - 1))
            self._schedule_promotion(entry)
        expired: list[QueueEntry] = []
        while self._expiries and self._expiries[0][0] <= now:
            entry = heapq.heappop(self._expiries)[2]
            if entry.queued and self.remove(entry.request_id) is not None:
                expired.append(entry)
        self._compact_time_heaps()
        return promotions, expired

    def _compact_time_heaps(self) -> None:
        # Withdrawn entries linger in the time heaps until due; rebuild when
        # they dominate so memory follows the live queue, not its history.
        live = len(self._entries)
        if len(self._expiries) > 2 * live + _COMPACT_SLACK:
            self._expiries = [item for item in self._expiries if item[2].queued]
            heapq.heapify(self._expiries)
        if len(self._promotions) > 2 * live + _COMPACT_SLACK:
            self._promotions = [
                item for item in self._promotions if item[3].queued and item[3].cls == item[2]
            ]
            heapq.heapify(self._promotions)
        for cls, held in self._held.items():
            if len(held) > 2 * self.classes[cls].live + _COMPACT_SLACK:
                self._held[cls] = [item for item in held if item[3].queued and item[3].cls == cls]

    def peek(self) -> QueueEntry | None:
        """The request that leaves next: best class not paused first, then
        fairness."""
        for queue in self.in_order():
            if queue.live and queue.cls not in self._paused:
                return queue.peek()
        return None

    def pop(self, entry: QueueEntry) -> None:
        """Take out `entry`, which `peek` just returned."""
        del self._entries[entry.request_id]
        self._queue_of(entry).pop(entry)

    def positions(self) -> Iterator[tuple[QueueEntry, int]]:
        """Every queued entry with its position (0 = next), assuming
        round-robin rounds in each class and no new arrivals. O(n log n)."""
        position = 0
        for queue in self.in_order():
            active = list(queue.tenant_entries())
            rank = 0
            while active:
                still = []
                for tenant, entries in active:
                    yield entries[rank], position
                    position += 1
                    if rank + 1 < len(entries):
                        still.append((tenant, entries))
                active = still
                rank += 1

    def position_of(self, entry: QueueEntry) -> int:
        """Cheap estimate for one entry, taking it as the last of its tenant
        in its class: O(tenants)."""
        queue = self._queue_of(entry)
        ahead = 0
        for other in self.in_order():  # every queue that leaves before this one
            if other is queue:
                break
            ahead += other.live
        rank = max(0, queue.tenant_count(entry.tenant) - 1)
        return ahead + queue.estimate_position(entry.tenant, rank)

    def class_len(self, cls: int) -> int:
        """Requests waiting on the ladder at rank `cls` (classes apart not counted)."""
        return self.classes[cls].live

    def apart_len(self, klass: PriorityClass) -> int:
        """Requests of `klass`, a class off the ladder, waiting."""
        return self.apart[klass].live

    def in_order(self) -> list[ClassQueue]:
        """Every class queue in the order they leave: the ladder, then the rest."""
        return self._in_order

    def tenant_len(self, tenant: str) -> int:
        """The tenant's queued requests its cap counts: the ladder's (a class
        off it has a cap of its own, CapScope.OWN: classes.py checks)."""
        return sum(q.tenant_count(tenant) for q in self.classes)

    def oldest_arrival(self, cls: int, tenant: str) -> float | None:
        for t, entries in self.classes[cls].tenant_entries():
            if t == tenant and entries:
                return min(e.arrival for e in entries)
        return None
