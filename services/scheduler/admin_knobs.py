"""The core's handlers of the operator's knobs (kvmesh.v1.Admin, served by
admin_api.py): pause / resume a priority class, drain / undrain an engine,
switch the placement policy -- without a restart.

Ownership: one `AdminKnobs` per `SchedulerCore`, which alone calls it, from
`handle` (so only on the event loop's thread, see core.py); like every
event, each knob is followed by a dispatch, so a resumed class or an
undrained engine takes work at once.

The rules:
  pause   a paused class dispatches nothing (queue.py): its requests stay
          queued with their streams open, admission goes on within the queue
          caps, TTLs still apply, and no request ages out of a paused class
          until it is resumed (then aging catches up). Requests already
          running are not touched; a Replace (a running request whose engine
          failed) is not held either: it was dispatched before the pause.
  drain   the engine gets no new placement (the fleet hides it from
          placement, whatever a policy's filters); with `move` it is told to
          drain and hand its running generations over, which their gateways
          continue on other engines. Undrain lets it take work again (and
          tells a connected engine to serve again). Drained ids are kept
          while the engine is away: one that reconnects stays drained.
  policy  the named policy is built fresh (its round-robin position and
          approximate prefix memory start empty) and used from the next
          placement on; metrics label placements with the new name.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from services.common.metric_labels import priority_label

from . import events as ev
from .events import Outbox
from .fleet import EngineFleet
from .metrics import SchedulerMetrics
from .records import NUM_CLASSES
from .waiting import WaitingRoom

__all__ = ["AdminKnobs"]

log = logging.getLogger(__name__)


class AdminKnobs:
    def __init__(
        self, waiting: WaitingRoom, fleet: EngineFleet, metrics: SchedulerMetrics,
        use_policy: Callable[[str], None],
    ) -> None:
        self._waiting = waiting
        self._fleet = fleet
        self._metrics = metrics
        self._use_policy = use_policy

    def handlers(self) -> dict[type, Callable[..., None]]:
        return {ev.ClassPaused: self.pause, ev.EngineDrainSet: self.drain, ev.PolicyChosen: self.policy}

    def pause(self, event: ev.ClassPaused, out: Outbox, now: float) -> None:
        if not 0 <= event.priority < NUM_CLASSES:
            raise ValueError(f"priority must be 0 .. {NUM_CLASSES - 1} (P0 .. P{NUM_CLASSES - 1}), "
                             f"got {event.priority}")
        if event.paused:
            self._waiting.paused.add(event.priority)
        else:
            self._waiting.paused.discard(event.priority)
        self._metrics.admissions_paused.labels(priority_label(event.priority)).set(1 if event.paused else 0)

    def drain(self, event: ev.EngineDrainSet, out: Outbox, now: float) -> None:
        record = self._fleet.get(event.engine_id)
        self._fleet.epoch += 1   # the spare keeper re-ranks the engines (spares.py)
        if event.drained:
            self._fleet.admin_drained.add(event.engine_id)
            if record is not None and event.move:
                record.draining = True
                out.commands.append((event.engine_id, ev.EngineCommand.MOVE_AWAY))
            return
        self._fleet.admin_drained.discard(event.engine_id)
        if record is not None:
            record.draining = False
            out.commands.append((event.engine_id, ev.EngineCommand.UNDRAIN))

    def policy(self, event: ev.PolicyChosen, out: Outbox, now: float) -> None:
        self._use_policy(event.name)
