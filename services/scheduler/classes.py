"""Priority classes as data: one closed enum of the classes and ONE table of
what each may do, built from the scheduler config. Every scheduler module
reads the table (queue, admission, preemption, placement, deadlines,
metrics, GetState); none tests for a particular class. Adding a class, or
changing what one may do, is a row here.

The classes:
  P0     interactive (TTFT target < 500 ms);
  P1     near-real-time;
  P2     offline work sent by a client, with aging so it never starves;
  BATCH  a Batch API line (AdmitRequest.batch): runs as P2 and stays there.
         Nobody waits on its stream and its deadline is hours away, so it
         gives way to everything: never aged (a flood can never reach P0 by
         waiting), after every ordinary P2, never a P0-reserved lease slot,
         the first preemption victim and never protected, a cap of its own.

The wire (scheduler.proto) is unchanged: a request's class is derived from
its priority and batch flag in one place, `class_of` below; `wire_batch`
is the inverse for GetState.

Ranks are explicit numbers in the table (`ClassRules.rank`: 0 = the top of
the aging ladder), never the enum's order (STYLE.md item 4).
"""

from __future__ import annotations

import enum
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

from services.common.config import SchedulerConfig

if TYPE_CHECKING:
    from .records import AdmitOptions

__all__ = [
    "CapScope", "ClassRules", "ClassTable", "PriorityClass", "admitted_priority", "class_of",
    "class_problems", "wire_batch",
]


class PriorityClass(enum.Enum):
    """The scheduler's classes (closed; no meaning in the order)."""

    P0 = "P0"          # interactive
    P1 = "P1"          # near-real-time
    P2 = "P2"          # offline, aged so it never starves
    BATCH = "batch"    # a Batch API line (AdmitRequest.batch): gives way to everything


class CapScope(enum.Enum):
    """Which queue cap counts a queued request."""

    # The cap of the class it waits in now (after aging) and its tenant's
    # cap; at the tenant's cap a higher class may displace it.
    CLASS_NOW = "class_now"
    # Its own class's cap alone: never a tenant's, never displaced, displaces
    # nothing (a 50k-line batch neither fills P2 nor a tenant's room).
    OWN = "own"


@dataclass(frozen=True)
class ClassRules:
    """What one class may do. Static columns are declared in `_ROWS`; the
    numbers (caps, TTLs, aging, preemption) come from the scheduler config."""

    klass: PriorityClass
    rank: int                  # the rank it is admitted in (0 = P0): wire priority, GetState row, metric label
    label: str                 # metric label (services/common/metric_labels.py): its rank's "P<n>"
    name: str                  # in messages ("the P2 queue", "the batch queue")
    unit: str                  # what its queue holds, in messages ("requests", "lines")
    # On the aging ladder (the P0..P2 queues, moving up one rank per
    # threshold); False: a queue of its own after the ladder, never aged.
    ages: bool
    aging_seconds: float | None  # seconds in its rank before moving up; None = never (top, or off the ladder)
    # Seconds aging takes it from its rank to P0 (added to the queue-wait
    # floor: a derived bound never undoes the aging promise, deadlines.py).
    aging_to_top_seconds: float
    queue_cap: int
    cap_scope: CapScope
    ttl_seconds: float         # queue time-to-live from arrival, in the class admitted
    ttl_from_deadline: bool    # its TTL is the request's own deadline (batch_deadline_unix), when set
    # Its queue wait is a sample of the class's window and the derived
    # queue-wait bound applies to it (deadlines.py); False: its TTL alone.
    derived_queue_bound: bool
    fixed_ttl_reason: str      # why it expires, when not the derived bound
    may_preempt: bool          # may preempt in a rank of scheduler.preempt_classes
    # A victim before any other class, fleet-wide, and never protected by
    # max_preemptions: it resumes losslessly and nobody waits on its stream.
    expendable: bool
    # Its lease slots and KV blocks count as room in placement for a class
    # that preempts (batch_yield.py): one of its leases yields on a warm engine.
    yields_room: bool
    # May fill the engines' P0-reserved lease slots when its rank reaches P0
    # (and may take the together shortcut, which skips the slot filters).
    reserved_slots: bool
    # Its leases count as queueing when placing a P0 (fleet.py); False: a P0
    # runs in the engine's P0 headroom ahead of it.
    delays_p0: bool
    # Shown apart in GetState (QueueState.batch rows, ClassState.batch_*) and
    # in the kvmesh_scheduler_batch_* metrics, besides its rank's row.
    apart: bool


@dataclass(frozen=True)
class _Row:
    """The static columns of one class (their reasons are ClassRules')."""

    klass: PriorityClass
    rank: int
    unit: str
    ages: bool
    cap_scope: CapScope
    ttl_from_deadline: bool
    derived_queue_bound: bool
    fixed_ttl_reason: str
    may_preempt: bool
    expendable: bool
    yields_room: bool
    reserved_slots: bool
    delays_p0: bool
    apart: bool
    # CapScope.OWN: the SchedulerConfig field of its cap (else queue_caps[rank]).
    own_cap_setting: str = ""


def _ladder(klass: PriorityClass, rank: int) -> _Row:
    return _Row(klass, rank, "requests", ages=True, cap_scope=CapScope.CLASS_NOW, ttl_from_deadline=False,
                derived_queue_bound=True, fixed_ttl_reason="", may_preempt=True, expendable=False,
                yields_room=False, reserved_slots=True, delays_p0=True, apart=False)


_ROWS = (
    _ladder(PriorityClass.P0, 0),
    _ladder(PriorityClass.P1, 1),
    _ladder(PriorityClass.P2, 2),
    _Row(PriorityClass.BATCH, 2, "lines", ages=False, cap_scope=CapScope.OWN, ttl_from_deadline=True,
         derived_queue_bound=False, fixed_ttl_reason="the end of its batch's completion window",
         may_preempt=False, expendable=True, yields_room=True, reserved_slots=False, delays_p0=False,
         apart=True, own_cap_setting="batch_queue_cap"),
)

# The aging ladder, by rank.
_LADDER = tuple(row.klass for row in _ROWS if row.ages)


class ClassTable(Mapping[PriorityClass, ClassRules]):
    """Every class's rules, in table order (the ladder, then the rest)."""

    def __init__(self, rules: Mapping[PriorityClass, ClassRules], preempt_ranks: frozenset[int]) -> None:
        self._rules = dict(rules)
        self._preempt_ranks = preempt_ranks

    @classmethod
    def from_config(cls, config: SchedulerConfig) -> ClassTable:
        return cls({row.klass: _rules(row, config) for row in _ROWS}, frozenset(config.preempt_classes))

    def __getitem__(self, klass: PriorityClass) -> ClassRules:
        return self._rules[klass]

    def __iter__(self) -> Iterator[PriorityClass]:
        return iter(self._rules)

    def __len__(self) -> int:
        return len(self._rules)

    @staticmethod
    def ladder() -> tuple[PriorityClass, ...]:
        """The aging ladder's classes, by rank (index = rank)."""
        return _LADDER

    def at_rank(self, rank: int) -> ClassRules:
        """The ladder class of `rank` (a request aged to rank r waits in its queue)."""
        return self._rules[_LADDER[rank]]

    def preempts(self, klass: PriorityClass, rank: int) -> bool:
        """A request of `klass` waiting in `rank` may preempt lower ranks
        (scheduler.preempt_classes) and sees yielding classes' room."""
        return rank in self._preempt_ranks and self._rules[klass].may_preempt

    def apart(self) -> list[PriorityClass]:
        """Classes GetState and the metrics show apart (ClassRules.apart)."""
        return [k for k, r in self._rules.items() if r.apart]


def _rules(row: _Row, config: SchedulerConfig) -> ClassRules:
    """One class's rules: its static row plus the numbers from the config."""
    # Off the ladder there is no "class it waits in now" but its own, so its
    # cap is its own; on it, the cap of the rank it has aged to.
    own = row.cap_scope is CapScope.OWN
    if own == row.ages or own != bool(row.own_cap_setting):
        raise ValueError(f"class {row.klass.value}: a cap of its own exactly when off the aging ladder")
    aging = config.aging
    static = {f.name: getattr(row, f.name) for f in fields(row) if f.name != "own_cap_setting"}
    return ClassRules(
        **static, label=f"P{row.rank}", name=f"P{row.rank}" if row.ages else row.klass.value,
        aging_seconds=(None, aging.p1_seconds, aging.p2_seconds)[row.rank] if row.ages else None,
        aging_to_top_seconds=(0.0, aging.p1_seconds, aging.p1_seconds + aging.p2_seconds)[row.rank]
        if row.ages else 0.0,
        queue_cap=getattr(config, row.own_cap_setting) if row.own_cap_setting else config.queue_caps[row.rank],
        ttl_seconds=config.queue_ttl_seconds[row.rank])


# ---------------------------------------------------------------- the wire

def class_of(options: AdmitOptions) -> PriorityClass:
    """The one place an admission's class is derived from the wire's
    priority and batch flag (valid options: class_problems is empty)."""
    return PriorityClass.BATCH if options.batch else _LADDER[options.priority]


def admitted_priority(priority: int, batch: bool) -> int:
    """The priority an admission runs at: a batch line's class's rank,
    whatever priority the gateway put."""
    return _RANKS[PriorityClass.BATCH] if batch else priority


def class_problems(options: AdmitOptions) -> list[str]:
    """What is wrong with an admission's priority and batch flag."""
    priority, batch = options.priority, options.batch
    if not 0 <= priority < len(_LADDER):
        return [f"priority {priority} is not in 0..{len(_LADDER) - 1}"]
    if batch and priority != _RANKS[PriorityClass.BATCH]:
        return [f"a batch line runs as P{_RANKS[PriorityClass.BATCH]}, got priority {priority}"]
    return []


def wire_batch(klass: PriorityClass) -> bool:
    """scheduler.proto's `batch` flag for a class (GetState's rows)."""
    return klass is PriorityClass.BATCH


_RANKS = {row.klass: row.rank for row in _ROWS}
