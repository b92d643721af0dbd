"""What `SchedulerCore.state()` returns: the read-only view GetState and
`kvmesh top` show (grpc_api.py turns it into `SchedulerState`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .class_stats import ClassStat
from .fleet import EngineStat
from .waiting import QueueStat

if TYPE_CHECKING:
    from .deadlines import Deadline
    from .scaling import ScalingDecision

__all__ = ["StateView"]


@dataclass(frozen=True)
class StateView:
    policy: str
    queues: list[QueueStat]
    engines: list[EngineStat]
    queued_total: int
    leases_total: int
    classes: list[ClassStat]
    # The operator's knobs (admin_knobs.py): paused classes, drained engine ids.
    paused: list[int] = field(default_factory=list)
    drained: list[str] = field(default_factory=list)
    # The deadline book's values (deadlines.py), per kind, model and class.
    deadlines: list[Deadline] = field(default_factory=list)
    # The scaling policy's figure per model (scaling/scaler.py).
    scaling: list[ScalingDecision] = field(default_factory=list)
    # The other replicas heard from within scheduler.peers.stale_seconds (peer_heads.py).
    peers: list[str] = field(default_factory=list)
