"""Warm spares: which connected engines of each model the scheduler holds
out of placement, when it promotes one, and when one returns.

An engine is a spare by the scheduler's choice, not its own: it is loaded,
warmed, connected and reporting like any other (healthy, ready, in GetState
and `kvmesh top` with `spare`), but placement skips it (fleet.py: `views`
and the eligibility test leave out `EngineFleet.spares`). Promotion is
taking it out of that set -- no message to the engine, no cold KV, so the
dispatch that follows the decision places on it at once.

Rules (config: `scheduler.spares`, services/common/config/spares.py;
arithmetic: spare_rules.py):
  held     per model, how many spares are wanted now: the configured count,
           less promotions, plus returns; never every engine of the model,
           nor the last one that reports serving (one still starting
           serves no one).
  order    a model's engines (draining ones left out) in `engine_order_key`
           order; the spares are taken from its end, promoted from the first
           of them, returned from the last idle serving engine.
  promote  in every `review` (after each event's dispatch): when the
           predicted first token of a class with a target (P0, P1 by
           default) would miss it for `promote_hold_seconds` (0: at once),
           one spare of the model is promoted; the dispatch runs again.
           Also when the model's engines fell below held + 1 (one left).
  return   in the tick: after `demote_hold_seconds` of calm (nothing queued,
           the leases fit in all serving engines but one at
           `demote_below_utilization`), held goes up by one and the last
           serving engine in order that is idle -- no lease, nothing running
           or waiting in its report -- becomes a spare. An engine holding
           leases is never chosen; returning one only stops new placements
           (its streams, if any, would finish). The calm clock restarts after
           every promotion and every return: no flapping within the hold.

Several scheduler replicas: every replica sees the same engines and reports,
and ranks them in the same order, so at start-up and on every return of an
idle engine their spare sets agree. A promotion follows the promoting
replica's own queue (replicas do not share queues): until the others see the
same pressure they still hold that engine spare -- they place elsewhere, the
promoting replica places on it, nothing is lost; the engines no replica
places on are at most the spares of the replica holding the fewest.

Ownership: the core owns the keeper and calls it only from `handle` (its one
thread, core.py); it changes the fleet's spare set and nothing else.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

from services.common.config import SparesConfig

from .engine_registry import EngineRecord
from .events import Delivery
from .fleet import EngineFleet
from .metrics import SchedulerMetrics
from .placement import PlacementRequest
from .records import AdmitOptions, PlacedInfo
from .spare_rules import ClassBacklog, Serving, calm, engine_order_key, predicted_first_token
from .waiting import WaitingRoom

__all__ = ["SpareKeeper"]

log = logging.getLogger(__name__)

# kvmesh_scheduler_spare_promotions_total's reasons: queued work would miss
# its target; the model's engines fell to the spares held (one left).
_REASONS = ("slo", "fleet")


@dataclass
class _ModelSpares:
    held: int                         # spares wanted now (<= the configured count)
    miss_since: float | None = None   # a predicted miss seen continuously since
    calm_since: float | None = None   # calm seen continuously since


@dataclass(frozen=True)
class _Settled:
    freed: bool       # an engine left the spares (dispatch again)
    returned: int     # spares added less spares removed


@dataclass(frozen=True)
class _Promoted:
    model: str
    decided_at: float
    placed: bool = False


class SpareKeeper:
    def __init__(self, config: SparesConfig, fleet: EngineFleet, waiting: WaitingRoom,
                 metrics: SchedulerMetrics, fallback_tokens_per_second: float, models: Iterable[str] = ()) -> None:
        self._config = config
        self._fleet = fleet
        self._waiting = waiting
        self._metrics = metrics
        self._fallback = fallback_tokens_per_second
        self._on = config.count > 0 or any(n > 0 for n in config.models.values())
        self._models: dict[str, _ModelSpares] = {}
        self._order: dict[str, list[str]] = {}    # model -> its engines in order (not draining)
        self._epoch = -1                           # the fleet's membership epoch `_order` is of
        # Promoted engines not yet placed on / given a first token, by engine id.
        self._promoted: dict[str, _Promoted] = {}
        for model in models:   # the configured models' series exist at 0 from the start (boards, alerts)
            for reason in _REASONS:
                metrics.spare_promotions.labels(model, reason)
            metrics.spare_returns.labels(model)

    # ------------------------------------------------------------ the core's calls

    def review(self, now: float, look: bool = True) -> bool:
        """Promote where queued work would miss its target (or engines left);
        True = something was promoted (dispatch again). `look` False: only
        membership changes (the core looks at the queues after the events
        that add waiting work, and on every tick: a load report, thousands
        a second in a large fleet, adds none, and the waits it lets grow
        are the tick's to see)."""
        if not self._on:
            return False
        promoted = self._sync(now)
        for model in self._order if look else ():
            # Cheapest first.
            if not self._waiting_work(model) or not self._spares_of(model):
                if model in self._models:
                    self._models[model].miss_since = None
            elif self._would_miss(model, now):
                promoted = self._promote(model, now) or promoted
        return promoted

    def _waiting_work(self, model: str) -> int:
        """Requests of `model` queued or waiting in its Replace lane."""
        queue = self._waiting.existing_queue(model)
        return (len(queue) if queue is not None else 0) + len(self._waiting.lane(model) or ())

    def tick(self, now: float) -> bool:
        """Returns after calm, spares for engines that became idle; True = a promotion."""
        if not self._on:
            return False
        promoted = self._sync(now)
        for model in self._order:
            state = self._state(model)
            if not calm(self._serving(model, now), self._waiting_work(model), self._config.demote_below_utilization):
                state.calm_since = None
            elif state.calm_since is None:
                state.calm_since = now
            elif now - state.calm_since >= self._config.demote_hold_seconds \
                    and state.held < self._config.for_model(model):
                state.held += 1
                if self._settle(model, now).returned > 0:
                    state.calm_since = now
                else:
                    state.held -= 1       # nothing idle to return now: the next tick tries again
            promoted = self._settle(model, now).freed or promoted
        return promoted

    def placed(self, notices: Iterable[Delivery], now: float) -> None:
        """Time the first placement on each promoted engine."""
        if not self._promoted:
            return
        for _, notice in notices:
            if isinstance(notice, PlacedInfo):
                promoted = self._promoted.get(notice.engine_id)
                if promoted is not None and not promoted.placed:
                    self._metrics.spare_promotion_seconds.observe(max(0.0, now - promoted.decided_at))
                    self._promoted[notice.engine_id] = _Promoted(promoted.model, promoted.decided_at, True)

    def first_token(self, engine_id: str, at: float) -> None:
        """A first token on `engine_id`: time it for a promoted engine (once)."""
        promoted = self._promoted.pop(engine_id, None) if self._promoted else None
        if promoted is not None:
            self._metrics.spare_first_token_seconds.observe(max(0.0, at - promoted.decided_at))

    # ------------------------------------------------------------ membership

    def _sync(self, now: float) -> bool:
        """Re-rank the engines after a join, leave or drain, then settle each
        model to its held count; True = a promotion (an engine left)."""
        if self._fleet.epoch == self._epoch:
            return False
        self._epoch = self._fleet.epoch
        order: dict[str, list[str]] = {}
        for record in self._fleet:
            if self._config.for_model(record.info.model) > 0 and not self._draining(record):
                order.setdefault(record.info.model, []).append(record.engine_id)
        for ids in order.values():
            ids.sort(key=engine_order_key)
        self._order = order
        ranked = {e for ids in order.values() for e in ids}
        self._fleet.spares.intersection_update(ranked)
        for gone in [e for e in self._promoted if e not in ranked]:
            del self._promoted[gone]
        promoted = False
        for model in order:
            promoted = self._settle(model, now).freed or promoted
        return promoted

    def _draining(self, record: EngineRecord) -> bool:
        return record.draining or record.engine_id in self._fleet.admin_drained

    def _state(self, model: str) -> _ModelSpares:
        state = self._models.get(model)
        if state is None:
            state = self._models[model] = _ModelSpares(self._config.for_model(model))
        return state

    def _spares_of(self, model: str) -> list[str]:
        spares = self._fleet.spares
        return [e for e in self._order.get(model, ()) if e in spares]

    def _settle(self, model: str, now: float) -> _Settled:
        """Bring the model's spares to min(held, engines - 1), each the last
        in order that is a spare already or idle: the same facts give every
        replica the same set. A spare beyond the count is promoted (engines
        left: reason "fleet"); one earlier in order than an idle serving
        engine trades places with it (both idle: no promotion)."""
        order, spares = self._order.get(model, []), self._fleet.spares
        target = max(0, min(self._state(model).held, len(order) - 1))
        records = {e: r for e in order if (r := self._fleet.get(e)) is not None}
        # Never the last engine that reports serving: one still starting serves no one.
        serving_left = sum(r.load.serving for r in records.values())
        wanted: list[str] = []
        for engine_id in reversed(order):
            if len(wanted) >= target:
                break
            record = records.get(engine_id)
            if record is None or not (engine_id in spares or _idle(record)):
                continue
            if record.load.serving:
                if serving_left <= 1:
                    continue
                serving_left -= 1
            wanted.append(engine_id)
        removed = [e for e in order if e in spares and e not in wanted]
        added = [e for e in wanted if e not in spares]
        promotions = max(0, len(removed) - len(added))
        for i, engine_id in enumerate(removed):
            if i < promotions:
                self._promote_engine(model, engine_id, now, "fleet")
            else:
                spares.discard(engine_id)
        for engine_id in added:
            spares.add(engine_id)
            self._promoted.pop(engine_id, None)
            self._metrics.spare_returns.labels(model).inc()
            log.info("engine %s (%s) held as a warm spare", engine_id, model)
        return _Settled(bool(removed), len(added) - len(removed))

    # ------------------------------------------------------------ promotion

    def _would_miss(self, model: str, now: float) -> bool:
        """A class with a target would miss it (spare_rules.py), for
        promote_hold_seconds now."""
        state = self._state(model)
        miss = self._miss_now(model, now)
        if not miss:
            state.miss_since = None
            return False
        if state.miss_since is None:
            state.miss_since = now
        return now - state.miss_since >= self._config.promote_hold_seconds

    def _miss_now(self, model: str, now: float) -> bool:
        """Queued work of a class with a target would miss it. A replacement
        (a stream whose engine failed, waiting in its model's Replace lane,
        ahead of the queues) counts as its class's head since its Replace."""
        targets, paused = self._config.ttft_target_seconds, self._waiting.paused
        serving: list[Serving] | None = None
        for rec in (self._waiting.lane(model) or {}).values():
            rank = rec.options.priority
            if 0 <= rank < len(targets) and targets[rank] > 0:
                serving = self._serving(model, now) if serving is None else serving
                backlog = ClassBacklog(rank, max(0.0, now - rec.replaced_at), 0, 1, _request(rec.options, rank))
                if predicted_first_token(backlog, serving, self._fallback) > targets[rank]:
                    return True
        queue = self._waiting.existing_queue(model)
        if queue is None or not len(queue):
            return False
        ahead = 0
        for rank, klass in enumerate(queue.classes):
            count = klass.live
            if count and rank < len(targets) and targets[rank] > 0 and rank not in paused:
                head = klass.peek()
                if head is not None:
                    serving = self._serving(model, now) if serving is None else serving
                    backlog = ClassBacklog(rank, max(0.0, now - head.arrival), ahead, count,
                                           _request(head.options, rank))
                    if predicted_first_token(backlog, serving, self._fallback) > targets[rank]:
                        return True
            ahead += count
        return False

    def _serving(self, model: str, now: float) -> list[Serving]:
        """The model's engines that may take work now (not spare, serving,
        fresh, not draining), with their service times."""
        out: list[Serving] = []
        for view in self._fleet.views(model, now):   # spares and admin-drained left out
            record = self._fleet.get(view.engine_id)
            if record is not None and view.serving and view.fresh and not view.draining \
                    and view.engine_id not in self._fleet.spares:
                out.append(Serving(view, record.service_seconds))
        return out

    def _promote(self, model: str, now: float) -> bool:
        """Promote the model's first spare in order for queued work."""
        spares = self._spares_of(model)
        if not spares:
            return False
        state = self._state(model)
        state.held = max(0, state.held - 1)
        self._promote_engine(model, spares[0], now, "slo")
        return True

    def _promote_engine(self, model: str, engine_id: str, now: float, reason: str) -> None:
        state = self._state(model)
        self._fleet.spares.discard(engine_id)
        state.miss_since = state.calm_since = None
        if reason == "slo":   # timed for queued work; an engine that left is no request's wait
            self._promoted[engine_id] = _Promoted(model, now)
        self._metrics.spare_promotions.labels(model, reason).inc()
        log.info("warm spare %s (%s) promoted (%s)", engine_id, model, reason)


def _request(options: AdmitOptions, rank: int) -> PlacementRequest:
    """The request as placement would see it, cold (no prefix counted)."""
    return PlacementRequest(options.request_id, options.model, options.prompt_tokens, options.max_tokens,
                            priority=rank)


def _idle(record: EngineRecord) -> bool:
    """No lease here, nothing leased elsewhere, nothing running or waiting."""
    load = record.load
    return record.slots_taken == 0 and load.running == 0 and load.waiting == 0
