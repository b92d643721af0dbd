"""The core's handlers of engine Connect-stream events: join (hello), load
reports, KV events and snapshots, leave, drain.

Ownership: one `EngineEvents` per `SchedulerCore`, which alone calls it,
from `handle` (so only on the event loop's thread, see core.py); it acts on
the core's fleet (fleet.py), request book (request_book.py) and placement
policy, never on queues. An engine that is lost -- its stream ended, or a
newer process of its id superseded it (engine_registry.py) -- loses its
leases at once; their requests wait ORPHANED for their gateways, which
migrate them (Replace) when they see the engine fail.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from . import events as ev
from .events import Outbox
from .fleet import EngineFleet
from .metrics import SchedulerMetrics
from .placement import PlacementPolicy
from .request_book import RequestBook

__all__ = ["EngineEvents"]

log = logging.getLogger(__name__)


class EngineEvents:
    def __init__(
        self, fleet: EngineFleet, requests: RequestBook, policy: PlacementPolicy,
        metrics: SchedulerMetrics, touch_gauges: Callable[[str], None], stale_seconds: float,
        replacing: Callable[[], bool] = lambda: False,
    ) -> None:
        """`touch_gauges`: the engine's gauges may have changed (fleet_gauges.py);
        `replacing`: does a replacement wait (its exclusions may lift on an
        engine's progress alone: fleet.py `exclusions`)?"""
        self._replacing = replacing
        self._fleet = fleet
        self._requests = requests
        self.policy = policy  # the core swaps it (kvmesh.v1.Admin SetPlacementPolicy)
        self._metrics = metrics
        self._touch_gauges = touch_gauges
        self._stale_seconds = stale_seconds

    def handlers(self) -> dict[type, Callable[..., None]]:
        return {
            ev.EngineJoined: self.joined, ev.LoadReported: self.load,
            ev.KvEventsReported: self.kv_events, ev.KvSnapshotReported: self.kv_snapshot,
            ev.EngineLeft: self.left, ev.DrainRequested: self.drain,
        }

    def joined(self, event: ev.EngineJoined, out: Outbox, now: float) -> None:
        """Raises `DuplicateEngineError` / `SupersededEngineError` (nothing
        changes then). A hello that supersedes an older process of its id
        ends that one's leases as if the engine was lost."""
        joined = self._fleet.join(event.info, now)
        out.token = joined.token
        old = joined.superseded
        if old is not None:
            self.policy.forget_engine(event.info.engine_id)
            self._requests.orphan(joined.lost)
            out.superseded = ev.Superseded(
                old.info.address, old.info.incarnation, old.fresh(now, self._stale_seconds), len(joined.lost))
        self._touch_gauges(event.info.engine_id)

    def load(self, event: ev.LoadReported, out: Outbox, now: float) -> None:
        """The engine's report; the prompts other replicas placed on it count
        as this replica's placements there (in-flight prefixes, live set)."""
        changed = self._fleet.report_load(event.engine_id, event.token, event.load, now)
        if changed:
            self._touch_gauges(event.engine_id)
        if changed is not None:
            for prefix in event.placed_elsewhere:
                self.policy.remember_prefix(prefix, event.engine_id)
        out.dispatch = bool(changed or event.placed_elsewhere or event.with_kv) or (
            changed is not None and self._replacing() and self._progressed(event.engine_id))

    def _progressed(self, engine_id: str) -> bool:
        record = self._fleet.get(engine_id)
        return record is not None and record.progressed

    def kv_events(self, event: ev.KvEventsReported, out: Outbox, now: float) -> None:
        out.dispatch = not event.in_report
        if self._fleet.kv_events(
            event.engine_id, event.token, event.seq, event.stored, event.removed, event.cleared
        ):
            self._metrics.resyncs.inc()
            out.commands.append((event.engine_id, ev.EngineCommand.RESYNC))

    def kv_snapshot(self, event: ev.KvSnapshotReported, out: Outbox, now: float) -> None:
        self._fleet.kv_snapshot(event.engine_id, event.token, event.seq, event.hashes)

    def left(self, event: ev.EngineLeft, out: Outbox, now: float) -> None:
        """Its leases end at once; their requests wait ORPHANED for the
        gateway, which sees the engine fail and Replaces or gives up."""
        ended = self._fleet.leave(event.engine_id, event.token, now)
        if ended is None:
            return
        self.policy.forget_engine(event.engine_id)
        self._requests.orphan(ended)
        self._touch_gauges(event.engine_id)

    def drain(self, event: ev.DrainRequested, out: Outbox, now: float) -> None:
        self._touch_gauges(event.engine_id)
        if self._fleet.drain(event.engine_id):
            out.commands.append((event.engine_id, ev.EngineCommand.DRAIN))
