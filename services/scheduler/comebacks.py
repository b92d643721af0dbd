"""Requests that come back after losing their lease, and the one place
they are queued again:

  Replace  the request's engine failed (the gateway saw it): its lease ends
           and it waits in its model's Replace lane, ahead of the queue,
           avoiding the engines it names, until its class TTL (or, while
           no engine it does not exclude serves, engine_return_seconds
           after the Replace, when longer: fleet.py `check_servable`);
           one that crosses our Preempted is queued as a Requeue, unless
           it excludes every engine of its model: then it waits in the lane;
  Requeue  its lease went to a higher class (core.py preempted it): it goes
           back into its class queue with its ORIGINAL arrival, so aging
           continues where it was, with the tokens it generated in its
           prompt.

Ownership rule: `Comebacks` is owned by `SchedulerCore` and called only from
`SchedulerCore.handle` (so only from the core's one thread, see core.py);
it changes records, the waiting room and leases only through the objects
the core hands it.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
from collections.abc import Callable

from . import events as ev
from .admission_limits import AdmissionLimits
from .class_stats import ClassLedger
from .events import Outbox
from .fleet import EngineFleet
from .queue import Promotion
from .records import AdmissionError, QueueEntry, RejectReason, RequestRecord, RequestState
from .request_book import RequestBook
from .waiting import WaitingRoom

__all__ = ["Comebacks"]

log = logging.getLogger(__name__)


class Comebacks:
    def __init__(
        self, book: RequestBook, waiting: WaitingRoom, fleet: EngineFleet, limits: AdmissionLimits,
        ledger: ClassLedger, seq: itertools.count[int], promoted: Callable[[list[Promotion]], None],
    ) -> None:
        self._book = book
        self._waiting = waiting
        self._fleet = fleet
        self._limits = limits
        self._ledger = ledger
        self._seq = seq
        self._promoted = promoted

    def replace(self, event: ev.ReplaceRequested, out: Outbox, now: float) -> None:
        """End the lease and queue the request in its model's Replace lane,
        ahead of the queue. The answer (Placed or Rejected) comes with this
        dispatch or a later one, when every eligible engine is full now."""
        rec = self._book.get(event.request_id)
        if rec is None:
            return
        crossed = rec.state is RequestState.PREEMPTED
        exclude = self._fleet.exclusions(event.exclude, rec.ran_on)
        try:
            if crossed:
                # Crossed our Preempted: its lease is gone already. It goes
                # back into its class queue as a Requeue would (behind the
                # request that preempted it), still avoiding the engines it
                # names -- unless those are every engine of its model: then
                # it waits in the Replace lane for one to come back, as any
                # replacement does, instead of being refused at once.
                opts = dataclasses.replace(rec.options, prompt_tokens=event.prompt_tokens,
                                           max_tokens=event.max_tokens, prefix_hashes=event.prefix_hashes)
                if event.prompt_tokens <= 0 or not self._fleet.check_servable(opts, exclude, now, replaced_at=now):
                    self._requeue(rec, event.prompt_tokens, event.max_tokens, event.prefix_hashes, exclude,
                                  out, now)
                    return
            elif rec.state not in (RequestState.PLACED, RequestState.ORPHANED):
                raise AdmissionError(RejectReason.INVALID, (
                    "replace is only valid after placed" if rec.state is RequestState.QUEUED
                    else "a replace is already pending"))
            self._book.end_lease(rec, now)
            rec.options = dataclasses.replace(
                rec.options, prompt_tokens=event.prompt_tokens, max_tokens=event.max_tokens,
                prefix_hashes=event.prefix_hashes,
            )
            rec.exclude = exclude
            if event.prompt_tokens <= 0:
                raise AdmissionError(RejectReason.INVALID, "replace: prompt_tokens must be > 0")
            waits_for_engine = self._fleet.check_servable(rec.options, rec.exclude, now, replaced_at=now)
        except AdmissionError as err:
            out.notices.append((event.request_id, self._book.reject(
                rec, now, err.reason, err.message, err.retry_after)))
            return
        rec.state = RequestState.REPLACING
        rec.replaced_at = now
        rec.replace_expires_at = now + self._limits.classes[rec.klass].ttl_seconds
        if waits_for_engine:
            rec.replace_expires_at = max(rec.replace_expires_at, self._fleet.return_deadline(now))
        self._waiting.add_replacement(rec)

    def requeue(self, event: ev.RequeueRequested, out: Outbox, now: float) -> None:
        """A preempted request comes back, with the tokens it generated in its
        prompt; anything else (a Requeue crossing a done, a repeat) is ignored."""
        rec = self._book.get(event.request_id)
        if rec is None or rec.state is not RequestState.PREEMPTED:
            log.debug("requeue for %s ignored: %s", event.request_id,
                      "unknown" if rec is None else rec.state.value)
            return
        self._requeue(rec, event.prompt_tokens, event.max_tokens, event.prefix_hashes,
                      frozenset(), out, now)

    def _requeue(
        self, rec: RequestRecord, prompt_tokens: int, max_tokens: int,
        prefix_hashes: tuple[int, ...], exclude: frozenset[str], out: Outbox, now: float,
    ) -> None:
        """Back into its class queue with its ORIGINAL arrival, so aging
        continues where it was. No TTL (expires_at = inf): it has streamed
        tokens to its client already, and rejecting it now would lose them;
        its wait is bounded by aging instead (it reaches P0, which nothing
        preempts, within the aging thresholds of its arrival). Caps do not
        apply either: it was admitted once."""
        if prompt_tokens <= 0:
            out.notices.append((rec.options.request_id, self._book.reject(
                rec, now, RejectReason.INVALID, "requeue: prompt_tokens must be > 0")))
            return
        rec.options = dataclasses.replace(
            rec.options, prompt_tokens=prompt_tokens, max_tokens=max_tokens,
            prefix_hashes=prefix_hashes)
        rec.exclude = exclude
        entry = QueueEntry(
            options=rec.options, seq=next(self._seq), arrival=rec.arrival,
            base_class=rec.options.priority, cls=rec.options.priority, expires_at=math.inf,
            resumed=True,
        )
        self._promoted(self._waiting.queue(rec.options.model).push(entry, now))
        rec.entry = entry
        rec.state = RequestState.QUEUED
        self._ledger.requeued(rec.options.priority)

