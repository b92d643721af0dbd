"""The state objects the scheduler core owns, handed together to the phase
modules it calls (admit.py, dispatch.py) instead of a long parameter list.

Ownership rule: built by `SchedulerCore` and shared only with the phase
objects it owns; they act on these only when the core calls them (its one
thread, see core.py).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from services.common.clock import Clock
from services.common.config import SchedulerConfig

from .admission_limits import AdmissionLimits, DispatchRateMeter
from .aging import AgingRule
from .classes import ClassTable
from .deadlines import DeadlineBook
from .fleet import EngineFleet
from .making_room import RoomMaker
from .metrics import SchedulerMetrics
from .peer_heads import PeerHeads
from .request_book import RequestBook
from .waiting import WaitingRoom

__all__ = ["CoreParts"]


@dataclass(frozen=True)
class CoreParts:
    config: SchedulerConfig
    clock: Clock
    metrics: SchedulerMetrics
    classes: ClassTable        # what each class may do (classes.py)
    aging: AgingRule
    limits: AdmissionLimits
    rate: DispatchRateMeter
    waiting: WaitingRoom
    fleet: EngineFleet
    requests: RequestBook
    room: RoomMaker            # its `policy` is the current placement policy (the core swaps it)
    deadlines: DeadlineBook
    seq: itertools.count[int]  # admission order: the queue's last tie-break
    peers: PeerHeads           # the other replicas' queue heads (peer_heads.py)

    def retry_after_for(self, cls: int) -> float:
        """Little's law over the requests queued in class `cls` and above."""
        now = self.clock.monotonic()
        ahead = sum(self.waiting.class_len(c) for c in range(cls + 1))
        return self.limits.retry_after(ahead, self.rate.rate(now))
