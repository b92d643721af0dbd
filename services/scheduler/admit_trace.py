"""The scheduler's `scheduler.admit` spans (README "Tracing";
services/common/tracing.py): one per placement decision a request waits
for -- its admission, and again after each `Replace` (its engine was lost)
or `Requeue` (it was preempted) -- from the message that asked until the
`Placed` or `Rejected` that answered, so a span's length is the request's
time in the scheduler's hands.

Each continues the gateway's `gateway.request` span, whose W3C context the
AdmitRequest carries (`trace_context`; else the call's metadata).
Attributes: `kvmesh.request_id`, `kvmesh.admit` (admit | replace |
requeue | resume | reattach), `kvmesh.priority` (as admitted),
`kvmesh.model`, `kvmesh.tenant`, `kvmesh.prompt_tokens`; when placed,
`kvmesh.engine`, `kvmesh.lease_id`, `kvmesh.cached_tokens`,
`kvmesh.queue_wait_s`, `kvmesh.policy`, `kvmesh.placement.kind` (warm |
cold | replace), `kvmesh.priority.effective` (the class after aging) and
`kvmesh.placement.scores` -- the policy's weighted score of each engine
that passed the filters, best first, as "engine=score" strings
(`kvmesh.placement.candidates` counts them); when rejected,
`kvmesh.status` = the reason. Events: `queued` (position, estimated wait),
`aging_promotion` (from, to; at the time the aging rule moved it) and
`placed`.

Placements are explained by the core only while tracing is on
(`SchedulerCore.explain`); off, every method returns at its first line.
Ownership: called from the servicer's handlers on the event loop only.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from services.common.clock import Clock
from services.common.proto.kvmesh.v1 import scheduler_pb2
from services.common.tracing import SERVER, Span, Tracing, trace_carrier

from .aging import AgingRule
from .records import Notice, PlacedInfo, PlacementDetail, QueuedInfo, RejectedInfo

__all__ = ["AdmitTraces"]

# Scores are rounded for reading; more engines than this are cut (the best kept).
_MAX_SCORES = 64


@dataclass
class _Open:
    carrier: Mapping[str, str]
    base: dict[str, str | int]
    span: Span | None = None
    queued_seen: bool = False


class AdmitTraces:
    """The open `scheduler.admit` span of each request that has one."""

    def __init__(self, tracing: Tracing, aging: AgingRule, clock: Clock) -> None:
        self._tracing = tracing
        self.enabled = tracing.enabled
        self._aging = aging
        self._clock = clock
        self._open: dict[str, _Open] = {}

    def begin(self, request_id: str, msg: scheduler_pb2.AdmitRequest, metadata: Mapping[str, str]) -> None:
        """An AdmitRequest arrived (its stream's first message)."""
        if not self.enabled:
            return
        kind = "resume" if msg.resume else "reattach" if msg.running_on_engine else "admit"
        base: dict[str, str | int] = {
            "kvmesh.request_id": request_id, "kvmesh.priority": msg.priority, "kvmesh.model": msg.model,
            "kvmesh.tenant": msg.tenant}
        if request_id in self._open:
            if not msg.resume:
                return  # a duplicate id (refused): the first request's trace is left alone
            self._end(request_id, "superseded")  # a resume takes the request over
        self._open[request_id] = _Open(dict(trace_carrier(metadata, msg.trace_context)), base)
        self._start(request_id, kind, msg.prompt_tokens)

    def again(self, request_id: str, kind: str, prompt_tokens: int) -> None:
        """A `replace` or `requeue`: the request waits for a placement again."""
        if self.enabled and request_id in self._open:
            self._end(request_id, "superseded")
            self._start(request_id, kind, prompt_tokens)

    def notice(self, request_id: str, notice: Notice) -> None:
        """A notice for the request's stream: Queued, Placed, Rejected..."""
        if not self.enabled:
            return
        entry = self._open.get(request_id)
        if entry is None or entry.span is None:
            return
        span = entry.span
        if isinstance(notice, QueuedInfo) and not entry.queued_seen:
            entry.queued_seen = True
            span.event("queued", {"kvmesh.position": notice.position + 1,
                                  "kvmesh.estimated_wait_s": notice.estimated_wait_seconds})
        elif isinstance(notice, PlacedInfo):
            span.set_many({"kvmesh.engine": notice.engine_id, "kvmesh.lease_id": notice.lease_id,
                           "kvmesh.cached_tokens": notice.cached_tokens})
            if notice.detail is not None:
                self._explain(span, notice.detail)
            span.event("placed")
            self._end(request_id, "placed")
        elif isinstance(notice, RejectedInfo):
            span.fail(notice.message[:200])
            self._end(request_id, notice.reason.value)
            self._open.pop(request_id, None)  # a rejection ends the stream

    def closed(self, request_id: str) -> None:
        """The Admit stream ended: the request is gone."""
        if self.enabled:
            self._end(request_id, "withdrawn")
            self._open.pop(request_id, None)

    # ------------------------------------------------------------ inside

    def _start(self, request_id: str, kind: str, prompt_tokens: int) -> None:
        entry = self._open[request_id]
        entry.queued_seen = False
        entry.span = self._tracing.span("scheduler.admit", remote=entry.carrier, kind=SERVER, attributes={
            **entry.base, "kvmesh.admit": kind, "kvmesh.prompt_tokens": prompt_tokens})

    def _end(self, request_id: str, status: str) -> None:
        entry = self._open.get(request_id)
        if entry is not None and entry.span is not None:
            entry.span.set("kvmesh.status", status)
            entry.span.end()
            entry.span = None

    def _explain(self, span: Span, detail: PlacementDetail) -> None:
        scores = [f"{s.view.engine_id}={s.score:.4f}" for s in detail.scores[:_MAX_SCORES]]
        span.set_many({
            "kvmesh.queue_wait_s": detail.queue_wait_s, "kvmesh.policy": detail.policy,
            "kvmesh.placement.kind": detail.kind, "kvmesh.placement.scores": scores,
            "kvmesh.placement.candidates": len(detail.scores)})
        entry = detail.entry
        if entry is None:
            return
        span.set("kvmesh.priority.effective", entry.cls)
        # Promotions happen at times fixed by arrival (aging.py): each one
        # as an event at its own moment, on the wall clock.
        now_mono, now_ns = self._clock.monotonic(), int(self._clock.wall() * 1e9)
        for cls in range(entry.base_class, entry.cls, -1):
            at = self._aging.next_promotion(entry.base_class, entry.arrival, cls)
            if at is not None:
                span.event("aging_promotion", {"kvmesh.from": cls, "kvmesh.to": cls - 1},
                           now_ns - int((now_mono - at) * 1e9))
