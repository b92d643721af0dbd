"""Records, closed enums and typed errors shared by the scheduler's modules.

The enums are closed sets used both as metric labels and as outcomes; no
meaning is hidden in their order.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .classes import ClassTable, PriorityClass, class_of

__all__ = [
    "NUM_CLASSES",
    "Notice",
    "RequestRecord",
    "AdmissionError",
    "AdmitOptions",
    "Lease",
    "Outcome",
    "PlacedDeadlines",
    "PlacedInfo",
    "PlacementDetail",
    "PreemptedInfo",
    "QueueEntry",
    "QueuedInfo",
    "RejectReason",
    "RejectedInfo",
    "RequestState",
    "SchedulerError",
]

# Ranks of the aging ladder: P0 (interactive), P1 (near-real-time), P2
# (offline); the classes themselves and their rules are classes.py's.
NUM_CLASSES = len(ClassTable.ladder())


class RequestState(enum.Enum):
    """Lifecycle of one admitted request (one Admit stream)."""

    QUEUED = "queued"          # waiting in a class queue
    REPLACING = "replacing"    # lost its engine, waiting ahead of the queue
    PLACED = "placed"          # holds a lease on an engine
    PREEMPTED = "preempted"    # its lease went to a higher class; waits for the gateway's Requeue
    ORPHANED = "orphaned"      # its engine went away; the gateway will Replace or leave
    DETACHED = "detached"      # its gateway went away; lease kept for a resume (detached_leases.py)
    FINISHED = "finished"      # final: done, withdrawn, rejected or expired


class RejectReason(enum.Enum):
    """Why a request was turned away; mirrors scheduler.proto's RejectCode."""

    QUEUE_FULL = "queue_full"
    TENANT_FULL = "tenant_full"
    EXPIRED = "expired"
    NO_ENGINE = "no_engine"
    TOO_LARGE = "too_large"
    INVALID = "invalid"
    DRAINING = "draining"
    RESUME_UNKNOWN = "resume_unknown"      # nothing to resume under that id
    RESUME_FORBIDDEN = "resume_forbidden"  # another tenant's (or model's) request


class Outcome(enum.Enum):
    """How a request's time in the scheduler ended (metric label)."""

    DONE = "done"              # the gateway reported completion
    WITHDRAWN = "withdrawn"    # the Admit stream ended (client left, gateway gone)
    REJECTED = "rejected"


class SchedulerError(Exception):
    """Base of the scheduler's domain errors (mapped to gRPC in grpc_api.py)."""


class AdmissionError(SchedulerError):
    """A request cannot be admitted; carries the reject reason."""

    def __init__(self, reason: RejectReason, message: str, retry_after: float = 0.0) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.retry_after = retry_after


@dataclass(frozen=True)
class AdmitOptions:
    """One request's summary as the gateway sends it (AdmitRequest)."""

    request_id: str
    model: str
    tenant: str = ""
    priority: int = 1
    prompt_tokens: int = 0
    max_tokens: int = 0
    prefix_hashes: tuple[int, ...] = ()
    arrival_unix: float = 0.0
    running_on_engine: str = ""
    resume: bool = False       # re-attach a detached lease (detached_leases.py)
    together_with: str = ""    # lease on this request's engine at once (a choice of n > 1)
    # A Batch API line (AdmitRequest.batch), as the wire says it: the
    # scheduler reads its class (`klass`, classes.py) and that class's rules,
    # never this flag.
    batch: bool = False
    batch_deadline_unix: float = 0.0  # its queue TTL as a Unix time; 0 = the P2 TTL

    @property
    def klass(self) -> PriorityClass:
        """Its class (classes.py derives it from priority and batch flag)."""
        return class_of(self)


@dataclass(eq=False)
class QueueEntry:
    """A request waiting in the queues. Identity-compared: heaps hold
    references and check `cls`/`queued` to skip stale copies (lazy removal)."""

    options: AdmitOptions
    seq: int                   # admission order: the last tie-break
    arrival: float             # monotonic seconds, arrival_unix honoured
    base_class: int            # class as admitted (TTL is the base class's)
    cls: int                   # class it waits in now (after aging)
    expires_at: float
    # Where expires_at came from (deadlines.Deadline.describe), for the
    # `expired` message; "" = the class's time-to-live.
    ttl_reason: str = ""
    queued: bool = True        # false once popped or withdrawn
    # Requeued after a preemption: it has streamed tokens already, so no
    # TTL (expires_at is inf) and never displaced by admission.
    resumed: bool = False

    @property
    def request_id(self) -> str:
        return self.options.request_id

    @property
    def tenant(self) -> str:
        return self.options.tenant

    @property
    def klass(self) -> PriorityClass:
        return self.options.klass


@dataclass
class Lease:
    """A placement: the request may run on the engine while this lives."""

    lease_id: str
    request_id: str
    engine_id: str
    placed_at: float
    reserved_blocks: int
    cached_tokens: int
    prompt_tokens: int
    cls: int = 1               # the class it was placed in (after aging): preemption compares it
    klass: PriorityClass = PriorityClass.P1  # its request's class (its rules: classes.py)
    first_token_at: float | None = None


@dataclass(frozen=True)
class QueuedInfo:
    position: int              # 0 = next to leave its model's queue
    estimated_wait_seconds: float
    priority: int


@dataclass(frozen=True)
class PlacedDeadlines:
    """The deadlines a `Placed` carries (deadlines.py; 0 = none: the
    gateway's fixed limits)."""

    first_token_seconds: float = 0.0
    token_stall_seconds: float = 0.0
    generation_seconds: float = 0.0
    token_stall_p95_seconds: float = 0.0


@dataclass(frozen=True)
class PlacedInfo:
    engine_id: str
    engine_address: str
    lease_id: str
    cached_tokens: int
    engine_incarnation: int = 0   # the engine process's EngineHello.incarnation
    # How the decision was made, for the request's trace (admit_trace.py);
    # None unless the core explains placements (tracing on).
    detail: PlacementDetail | None = None
    # Stamped by the core from its deadline book (deadlines.py) on the way out.
    deadlines: PlacedDeadlines | None = None


@dataclass(frozen=True)
class PlacementDetail:
    """A placement decision, explained: references to what the core had at
    hand anyway (nothing is computed for it; formatted only by a trace)."""

    policy: str
    kind: str                     # warm | cold | replace (the placements metric's label)
    queue_wait_s: float           # arrival (re-admissions keep theirs) -> placed; 0 from the Replace lane
    # Candidates after the filters, best first: placement.interfaces.ScoredEngine.
    scores: Sequence[Any]
    entry: QueueEntry | None      # the queue entry placed (base class, class now, arrival)


@dataclass(frozen=True)
class PreemptedInfo:
    """The request's lease ended for a higher class's request; the gateway
    stops the engine stream, keeps the tokens and answers Requeue."""

    engine_id: str
    preemptions: int           # times preempted, this one included
    by_priority: int           # class of the request that took the slot


@dataclass(frozen=True)
class RejectedInfo:
    reason: RejectReason
    message: str
    retry_after_seconds: float = 0.0


# What the core tells one waiting Admit stream.
Notice = QueuedInfo | PlacedInfo | RejectedInfo | PreemptedInfo


@dataclass
class RequestRecord:
    """Everything the core holds about one admitted request."""

    options: AdmitOptions
    state: RequestState
    entry: QueueEntry | None = None
    lease: Lease | None = None
    exclude: frozenset[str] = field(default_factory=frozenset)
    replace_expires_at: float = 0.0
    replaced_at: float = 0.0   # monotonic; when its last Replace came (REPLACING)
    awaits_engine: bool = False  # REPLACING: no engine it may use serves now (fleet.check_servable)
    arrival: float = 0.0       # monotonic; a requeue keeps it (aging continues)
    preemptions: int = 0       # times its lease went to a higher class
    preempted_at: float | None = None  # set while preempted and not placed again
    orphaned_from: str = ""    # ORPHANED: the engine whose registration ended under it
    # Engine id -> the incarnation of the process it was last leased on (0:
    # not sent): a Replace's exclusion of an id whose process changed since
    # does not hold (the failed process is gone; comebacks.py).
    ran_on: dict[str, int] = field(default_factory=dict)

    @property
    def klass(self) -> PriorityClass:
        return self.options.klass

    def holder(self) -> str | None:
        """The engine this request may run on (fencing.py): its lease's, or
        the one it was ORPHANED from (its gateway may still stream from it)."""
        if self.lease is not None:
            return self.lease.engine_id
        return self.orphaned_from if self.state is RequestState.ORPHANED else None
