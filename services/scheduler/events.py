"""What the transport tells the scheduler core (events) and what the core
hands back to deliver (`Outbox`).

`SchedulerCore.handle(event)` is the core's only mutating entry point: it
applies one event, then always runs dispatch, and returns one `Outbox` with
every notice and engine command that event caused -- the event's own answer
and whatever the dispatch placed or rejected. No caller can forget to
dispatch, because no caller dispatches.

Events are plain frozen records; the gRPC layer (grpc_api.py) builds them
from stream messages, the timers in server.py build `Tick`, and tests build
them directly.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

from .engine_registry import EngineInfo, EngineLoad
from .peer_heads import QueueHead
from .records import AdmitOptions, Notice

__all__ = [
    "ClassPaused",
    "Delivery",
    "DrainRequested",
    "EngineDrainSet",
    "EngineCommand",
    "EngineJoined",
    "EngineLeft",
    "Event",
    "FirstToken",
    "KvEventsReported",
    "KvSnapshotReported",
    "LoadReported",
    "Outbox",
    "PeerHeadsHeard",
    "PolicyChosen",
    "ReplaceRequested",
    "RequeueRequested",
    "RequestArrived",
    "RequestDone",
    "ShutdownStarted",
    "StreamClosed",
    "Superseded",
    "Tick",
]

# (request id, what to tell its Admit stream)
Delivery = tuple[str, Notice]


# ---------------------------------------------------------------- Admit streams

@dataclass(frozen=True)
class RequestArrived:
    """An Admit stream's first message: queue the request (or re-attach it
    to the engine it already runs on)."""

    options: AdmitOptions


@dataclass(frozen=True)
class StreamClosed:
    """The Admit stream ended: leave the queue / end the lease. Idempotent."""

    request_id: str


@dataclass(frozen=True)
class FirstToken:
    request_id: str
    # How long before it was told the token came (a gateway that tells it late).
    seconds_ago: float = 0.0


@dataclass(frozen=True)
class RequestDone:
    """The gateway reports completion: the lease ends now. `withdrawn`: it
    gave the request up (client gone, request failed; finish_reason "abort")
    -- ended at once like a closed stream, but never kept for a resume."""

    request_id: str
    withdrawn: bool = False
    # Gaps between the stream's deltas, sampled by the gateway (deadlines.py).
    delta_gaps: tuple[float, ...] = ()
    # The first token folded into the report, how long before it (None: told
    # on its own, or never came).
    first_token_ago: float | None = None
    # Its usage, for the scaling policy's demand (scaling/demand.py); 0 = not told.
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0


@dataclass(frozen=True)
class ReplaceRequested:
    """The request's engine failed: place it again, avoiding `exclude`."""

    request_id: str
    exclude: tuple[str, ...]
    prompt_tokens: int
    max_tokens: int
    prefix_hashes: tuple[int, ...]


@dataclass(frozen=True)
class RequeueRequested:
    """After `Preempted`: queue the request again in its class with its
    original arrival; prompt_tokens include the tokens generated so far and
    max_tokens is what is left. Ignored unless the request is PREEMPTED."""

    request_id: str
    prompt_tokens: int
    max_tokens: int
    prefix_hashes: tuple[int, ...]


# ---------------------------------------------------------------- Connect streams

@dataclass(frozen=True)
class EngineJoined:
    """An engine's hello. `handle` raises `SupersededEngineError` for an
    older process of an id a newer one took over, and (hellos without an
    incarnation) `DuplicateEngineError` when the id is connected from another
    address; nothing changes then (engine_registry.py)."""

    info: EngineInfo


@dataclass(frozen=True)
class LoadReported:
    engine_id: str
    token: int
    load: EngineLoad
    # Prompts other scheduler replicas placed on the engine since its last
    # report, as prefix hashes (LoadReport.placed_elsewhere): the policy
    # remembers each as if it had placed it. Empty with one scheduler.
    placed_elsewhere: Sequence[Sequence[int]] = ()
    # The report carried KV events (handled just before it, `in_report`).
    with_kv: bool = False


@dataclass(frozen=True)
class KvEventsReported:
    engine_id: str
    token: int
    seq: int
    # Any sequence: the gRPC layer passes the message's repeated fields
    # without copying them (KV events are the busiest engine message).
    stored: Sequence[int]
    removed: Sequence[int]
    cleared: bool
    # Inside a load report (LoadReport.kv_events): the report, handled next,
    # dispatches for both.
    in_report: bool = False


@dataclass(frozen=True)
class KvSnapshotReported:
    engine_id: str
    token: int
    seq: int
    hashes: Sequence[int]


@dataclass(frozen=True)
class EngineLeft:
    """The engine's Connect stream ended (only the current token counts)."""

    engine_id: str
    token: int


@dataclass(frozen=True)
class DrainRequested:
    """Stop placing on an engine; its running work finishes."""

    engine_id: str


# ---------------------------------------------------------------- the operator (kvmesh.v1.Admin)

@dataclass(frozen=True)
class ClassPaused:
    """Pause (or resume) dispatch from class `priority` (admin_knobs.py)."""

    priority: int
    paused: bool


@dataclass(frozen=True)
class EngineDrainSet:
    """Drain (or undrain) an engine by id; `move` also has it hand its
    running generations over."""

    engine_id: str
    drained: bool
    move: bool = False


@dataclass(frozen=True)
class PolicyChosen:
    """Place with the policy of this (known) name from now on."""

    name: str


# ---------------------------------------------------------------- the scheduler itself

@dataclass(frozen=True)
class Tick:
    """Housekeeping from the clock: aging, TTL expiry, gauges."""


@dataclass(frozen=True)
class PeerHeadsHeard:
    """Another scheduler replica's queue heads (peer_heads.py); `heads`
    None: its stream ended (it holds nothing back any more)."""

    replica: str
    heads: tuple[QueueHead, ...] | None


@dataclass(frozen=True)
class ShutdownStarted:
    """Reject everything still waiting with DRAINING; refuse new work."""


Event = (
    RequestArrived | StreamClosed | FirstToken | RequestDone | ReplaceRequested | RequeueRequested
    | EngineJoined | LoadReported | KvEventsReported | KvSnapshotReported | EngineLeft
    | DrainRequested | Tick | ShutdownStarted | ClassPaused | EngineDrainSet | PolicyChosen | PeerHeadsHeard
)


class EngineCommand(enum.Enum):
    """What the scheduler asks an engine over its Connect stream."""

    RESYNC = "resync"    # the KV event stream had a gap: send a snapshot
    DRAIN = "drain"      # take no new work; finish what runs
    MOVE_AWAY = "move_away"  # DRAIN, and hand what runs over to other engines now
    UNDRAIN = "undrain"  # take new work again


@dataclass
class Outbox:
    """Everything one handled event asks the transport to deliver.

    `notices` are in the order they happened. For `RequestArrived` the first
    notice is always the arriving request's own first answer (Queued,
    Placed on re-attach, or Rejected); a Rejected for a request it displaced
    at its tenant's cap, and a Placed or Rejected for it from the same
    dispatch, follow later in the list. A dispatch that preempts lists the
    victim's Preempted before the Placed of the request that took its slot.
    """

    notices: list[Delivery] = field(default_factory=list)
    commands: list[tuple[str, EngineCommand]] = field(default_factory=list)
    # EngineJoined only: the registration's token, which the engine's stream
    # presents with every later event (a stale stream's events are ignored).
    token: int = 0
    # EngineJoined only: the older process of the id this hello superseded
    # (its stream must end: the transport ends it FAILED_PRECONDITION).
    superseded: Superseded | None = None
    # False: the event changed nothing a placement reads (an engine's
    # heartbeat repeating its last load), so the core does not dispatch after
    # it. With a queue waiting (a busy fleet, a batch backlog), each dispatch
    # tries to place its head: at 1,024 engines the heartbeats alone (~2,000/s)
    # made that most of a core (BENCHMARKS.md "A busy fleet").
    dispatch: bool = True


@dataclass(frozen=True)
class Superseded:
    """An older process of an engine, replaced by a newer one's hello."""

    address: str
    incarnation: int
    # It reported within stale_report_seconds: if the new hello is not a
    # restart of it, two live engines share an id (the log says so).
    was_fresh: bool
    leases: int                   # its leases, ended (their requests wait ORPHANED)
