"""The gRPC face of the scheduler: turns Admit / Connect / GetState streams
into core events (events.py) and the core's `Outbox` back into stream
messages. It never dispatches: `SchedulerCore.handle` does after every
event, and everything it returns goes through `deliver`.

Concurrency rule: every handler, reader task and timer runs on one event
loop, and the core is called only synchronously from it (see core.py), so
the core has one owner without locks. Each Admit stream has a bounded
mailbox the core's notices are put into; its handler is the only writer of
its stream. A `Preempted` notice does not end the stream: the gateway
answers `Requeue` on it and a later `Placed` (or `Rejected`) follows.
Connect streams (engines' registration, reports, commands, fences and
superseded registrations) are engine_links.py's.

Domain outcomes become protobuf messages and gRPC status codes here
(`_to_proto`, `_REJECT_CODES`) and, for Connect, in engine_links.py.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any, TypeAlias, TypeVar, cast

import grpc

from services.common.clock import Clock, SystemClock
from services.common.config import MeshConfig
from services.common.idle_calls import IdleCalls
from services.common.proto.kvmesh.v1 import scheduler_pb2, scheduler_pb2_grpc
from services.common.scheduler_replica import new_replica_id
from services.common.tracing import NO_TRACING, Tracing

from . import events as ev
from .admit_many import CLIENT_GONE, AdmitManyCall, Mailbox
from .admit_trace import AdmitTraces
from .aging import AgingRule
from .classes import admitted_priority, wire_batch
from .core import SchedulerCore
from .engine_links import EngineLinks
from .incarnation_store import IncarnationStore
from .peer_feed import QueueHeadsFeed
from .peer_watch import PeerWatch
from .records import (
    AdmitOptions,
    Notice,
    PlacedInfo,
    PreemptedInfo,
    QueuedInfo,
    RejectedInfo,
    RejectReason,
)
from .state_view import StateView

__all__ = ["SchedulerServicer"]

log = logging.getLogger(__name__)

_REJECT_CODES = {
    RejectReason.QUEUE_FULL: scheduler_pb2.REJECT_CODE_QUEUE_FULL,
    RejectReason.TENANT_FULL: scheduler_pb2.REJECT_CODE_TENANT_FULL,
    RejectReason.EXPIRED: scheduler_pb2.REJECT_CODE_EXPIRED,
    RejectReason.NO_ENGINE: scheduler_pb2.REJECT_CODE_NO_ENGINE,
    RejectReason.TOO_LARGE: scheduler_pb2.REJECT_CODE_TOO_LARGE,
    RejectReason.INVALID: scheduler_pb2.REJECT_CODE_INVALID,
    RejectReason.DRAINING: scheduler_pb2.REJECT_CODE_DRAINING,
    RejectReason.RESUME_UNKNOWN: scheduler_pb2.REJECT_CODE_RESUME_UNKNOWN,
    RejectReason.RESUME_FORBIDDEN: scheduler_pb2.REJECT_CODE_RESUME_FORBIDDEN,
}

_COMMANDS = {
    ev.EngineCommand.RESYNC: scheduler_pb2.SchedulerCommand(resync=scheduler_pb2.Resync()),
    ev.EngineCommand.DRAIN: scheduler_pb2.SchedulerCommand(drain=scheduler_pb2.Drain()),
    ev.EngineCommand.MOVE_AWAY: scheduler_pb2.SchedulerCommand(drain=scheduler_pb2.Drain(hand_over=True)),
    ev.EngineCommand.UNDRAIN: scheduler_pb2.SchedulerCommand(undrain=scheduler_pb2.Undrain()),
}

# Delta gaps taken from one RequestDone (the gateway sends up to 16; more is
# a misbehaving client, not more information).
_MAX_GAPS = 64

# The servicer contexts of the two streams (strings: grpc.aio's classes are
# generic only in the type stubs).
_AdmitContext: TypeAlias = (
    "grpc.aio.ServicerContext[scheduler_pb2.AdmitClientMessage, scheduler_pb2.AdmitServerMessage]"
)
_AdmitManyContext: TypeAlias = (
    "grpc.aio.ServicerContext[scheduler_pb2.AdmitClientFrames, scheduler_pb2.AdmitServerFrames]"
)
_ConnectContext: TypeAlias = (
    "grpc.aio.ServicerContext[scheduler_pb2.EngineMessage, scheduler_pb2.SchedulerCommand]"
)

_In = TypeVar("_In")


async def _read(context: grpc.aio.ServicerContext[_In, Any]) -> _In | None:
    """The client's next message, or None at the end of its stream: grpc.aio
    returns EOF there, which the type stubs leave out of `read()`."""
    msg: object = await context.read()
    return None if msg is grpc.aio.EOF else cast(_In, msg)


def _to_proto(notice: Notice, replica: str) -> scheduler_pb2.AdmitServerMessage:
    if isinstance(notice, QueuedInfo):
        return scheduler_pb2.AdmitServerMessage(queued=scheduler_pb2.Queued(
            # The core counts from 0; the wire promises 1 = next to be placed.
            position=notice.position + 1, estimated_wait_seconds=notice.estimated_wait_seconds,
            priority=notice.priority))
    if isinstance(notice, PlacedInfo):
        return scheduler_pb2.AdmitServerMessage(placed=scheduler_pb2.Placed(
            engine_id=notice.engine_id, engine_address=notice.engine_address,
            lease_id=notice.lease_id, cached_tokens=notice.cached_tokens,
            engine_incarnation=notice.engine_incarnation, scheduler_replica=replica, ends_at_done=True,
            **_deadline_fields(notice)))
    if isinstance(notice, PreemptedInfo):
        return scheduler_pb2.AdmitServerMessage(preempted=scheduler_pb2.Preempted(
            engine_id=notice.engine_id, preemptions=notice.preemptions,
            by_priority=notice.by_priority))
    return scheduler_pb2.AdmitServerMessage(rejected=scheduler_pb2.Rejected(
        code=_REJECT_CODES[notice.reason], message=notice.message,
        retry_after_seconds=notice.retry_after_seconds))


def _deadline_fields(notice: PlacedInfo) -> dict[str, float]:
    d = notice.deadlines
    if d is None:
        return {}
    return {"first_token_seconds": d.first_token_seconds, "token_stall_seconds": d.token_stall_seconds,
            "generation_seconds": d.generation_seconds, "token_stall_p95_seconds": d.token_stall_p95_seconds}


def _options(msg: scheduler_pb2.AdmitRequest) -> AdmitOptions:
    # The admission boundary: a batch line runs at its class's rank whatever
    # priority the gateway put; its class is derived from these two fields
    # (classes.class_of), which nothing else in the scheduler reads.
    return AdmitOptions(
        request_id=msg.request_id, model=msg.model, tenant=msg.tenant,
        priority=admitted_priority(msg.priority, msg.batch),
        batch=msg.batch, batch_deadline_unix=msg.batch_deadline_unix,
        prompt_tokens=msg.prompt_tokens, max_tokens=msg.max_tokens,
        prefix_hashes=tuple(msg.prefix_hashes), arrival_unix=msg.arrival_unix,
        running_on_engine=msg.running_on_engine, resume=msg.resume, together_with=msg.together_with,
    )


def _state_proto(view: StateView) -> scheduler_pb2.SchedulerState:
    drained = set(view.drained)
    return scheduler_pb2.SchedulerState(
        policy=view.policy,
        queues=[
            scheduler_pb2.QueueState(priority=q.priority, tenant=q.tenant, queued=q.queued,
                                     oldest_wait_seconds=q.oldest_wait_seconds, batch=wire_batch(q.klass))
            for q in view.queues
        ],
        engines=[
            scheduler_pb2.EngineState(
                engine_id=e.view.engine_id, address=e.address, model=e.view.model,
                serving=e.view.serving, draining=e.view.draining, fresh=e.view.fresh,
                running=e.view.running, waiting=e.view.waiting, blocks_used=e.view.blocks_used,
                blocks_total=e.view.blocks_total, blocks_reserved=e.view.blocks_reserved,
                cached_blocks=e.cached_blocks, leases=e.view.leases, weight=e.view.weight,
                backend=e.backend, incarnation=e.incarnation, max_model_len=e.view.max_model_len,
                drained_by_admin=e.view.engine_id in drained, model_revision=e.model_revision,
                prefill_tokens_per_second=e.view.prefill_tokens_per_second, step_seconds=e.view.step_seconds,
                spare=e.spare)
            for e in view.engines
        ],
        queued_total=view.queued_total, leases_total=view.leases_total,
        classes=[
            scheduler_pb2.ClassState(
                priority=c.priority, preemptions=c.preemptions, requeued=c.requeued,
                preempted_now=c.preempted_now, seconds_lost=c.seconds_lost,
                displaced=c.displaced, protected=c.protected, batch_preemptions=c.batch_preemptions,
                batch_queued=sum(q.queued for q in view.queues if wire_batch(q.klass) and q.priority == c.priority))
            for c in view.classes
        ],
        paused_priorities=view.paused, drained_engines=view.drained,
        deadlines=[
            scheduler_pb2.DeadlineState(
                kind=d.kind.value, model=d.model, priority=d.priority, p95_seconds=d.p95 or 0.0,
                samples=d.samples, deadline_seconds=d.seconds, source=d.source.value)
            for d in view.deadlines
        ],
        scaling=[
            scheduler_pb2.ModelScaling(model=d.model, desired=d.desired, current=d.current, spares=d.spares,
                                       reason=d.reason, autoscaled=d.autoscaled)
            for d in view.scaling
        ],
        peers=view.peers,
    )


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(self, core: SchedulerCore, config: MeshConfig, clock: Clock | None = None,
                 tracing: Tracing = NO_TRACING, incarnations: IncarnationStore | None = None) -> None:
        self.core = core
        self._clock = clock or SystemClock()
        # This process's name among the replicas (scheduler_replica.py).
        self.replica = new_replica_id()
        # `scheduler.admit` spans (admit_trace.py); the core explains its
        # placements only for them.
        self.traces = AdmitTraces(tracing, AgingRule.from_config(config.scheduler.aging), self._clock)
        core.explain = tracing.enabled
        self.engine_links = EngineLinks(core, config, self._clock, self.deliver, incarnations, self.replica)
        # Generations engines run without a lease here (fencing.py).
        self.fences = self.engine_links.fences
        self._mailboxes: dict[str, Mailbox] = {}
        # Admit calls gateways opened ahead of their next request.
        self._idle_calls = IdleCalls()
        # Open AdmitMany calls (admit_many.py), told when the scheduler stops.
        self._many_calls: set[AdmitManyCall] = set()
        # Priority across replicas (peer_heads.py): this replica's queue heads
        # for the others, and theirs for the core.
        self.peer_feed = QueueHeadsFeed(self.replica, config.scheduler.peers, core.waiting.heads)
        self.peer_watch = PeerWatch(config, self.replica, lambda event: self.deliver(core.handle(event)))

    # ------------------------------------------------------------ delivery

    def deliver(self, outbox: ev.Outbox) -> None:
        """Put each notice into its Admit stream's mailbox and each command
        into its engine's; streams already gone are skipped."""
        for engine_id, command in outbox.commands:
            self.engine_links.command(engine_id, _COMMANDS[command])
        self._deliver_notices(outbox.notices)
        self.peer_feed.refresh()

    def _deliver_notices(self, notices: list[ev.Delivery]) -> None:
        for request_id, notice in notices:
            self.traces.notice(request_id, notice)
            if isinstance(notice, PlacedInfo):
                # One line per placement, keyed by the request id the gateway
                # took from x-request-id, so a request can be followed across logs.
                log.info("request %s placed on %s (lease %s, %d cached tokens)", request_id,
                         notice.engine_id, notice.lease_id, notice.cached_tokens)
            elif isinstance(notice, RejectedInfo):
                log.info("request %s rejected: %s", request_id, notice.reason.value)
            elif isinstance(notice, PreemptedInfo):
                log.info("request %s preempted on %s for a P%d request (%d so far)", request_id,
                         notice.engine_id, notice.by_priority, notice.preemptions)
            box = self._mailboxes.get(request_id)
            if box is not None:
                box.put_nowait(notice)

    def send_queued_updates(self) -> None:
        """Queued position updates, only into empty mailboxes (a slow stream
        gets the newest position later instead of a growing backlog)."""
        for request_id, info in self.core.queued_updates():
            box = self._mailboxes.get(request_id)
            if box is not None and box.empty():
                box.put_nowait(info)

    def tick(self) -> None:
        self.deliver(self.core.handle(ev.Tick()))

    def shutdown(self) -> None:
        self._idle_calls.close()
        self.deliver(self.core.handle(ev.ShutdownStarted()))
        for call in self._many_calls:
            call.close()

    def drain_engine(self, engine_id: str) -> bool:
        if engine_id not in self.engine_links.channels:
            return False
        outbox = self.core.handle(ev.DrainRequested(engine_id))
        self.deliver(outbox)
        return (engine_id, ev.EngineCommand.DRAIN) in outbox.commands

    # ------------------------------------------------------------ Admit

    async def Admit(
        self, request_iterator: AsyncIterator[scheduler_pb2.AdmitClientMessage], context: _AdmitContext
    ) -> None:
        first = await self._idle_calls.first_message(context)
        if first is grpc.aio.EOF:
            return
        if first.WhichOneof("msg") != "request":
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                "the first Admit message must be `request` (AdmitRequest)")
        metadata: dict[str, str] = {}
        if self.traces.enabled:
            metadata = {k: v for k, v in (context.invocation_metadata() or ()) if isinstance(v, str)}
        request_id, notice, outbox = self.arrive(first.request, metadata)
        if isinstance(notice, RejectedInfo):
            # No mailbox: a duplicate id must not take the first stream's.
            self.deliver(outbox)
            await context.write(_to_proto(notice, self.replica))
            return
        # Unbounded but small by protocol: Queued updates go only into an
        # empty box, and each admission or replace yields one Placed/Rejected.
        box: asyncio.Queue[object] = asyncio.Queue()
        self.open_box(request_id, box)
        reader = asyncio.create_task(self._read_admit(request_id, context, box))
        try:
            self.deliver(outbox)
            # A request placed on arrival never waited: skip the Queued
            # message, which would cost the gateway one more round trip
            # before its first token.
            if box.empty():
                await context.write(_to_proto(notice, self.replica))
            while True:
                item = box.get_nowait() if not box.empty() else await box.get()
                if item is CLIENT_GONE:
                    return
                # Mailboxes hold notices and the CLIENT_GONE sentinel only.
                await context.write(_to_proto(cast(Notice, item), self.replica))
                if isinstance(item, RejectedInfo):
                    return
        finally:
            reader.cancel()
            self.close_box(request_id, box)

    async def AdmitMany(
        self, request_iterator: AsyncIterator[scheduler_pb2.AdmitClientFrames], context: _AdmitManyContext
    ) -> None:
        call = AdmitManyCall(self, context)
        self._many_calls.add(call)
        try:
            await call.serve()
        finally:
            self._many_calls.discard(call)

    # ------------------------------------------------------------ Admit streams (both RPCs)

    def arrive(self, request: scheduler_pb2.AdmitRequest,
               metadata: dict[str, str]) -> tuple[str, Notice, ev.Outbox]:
        """An Admit stream's request: its id, its own first answer, and the
        rest of the core's outbox (a Placed for it from the same dispatch
        included), for the caller to deliver once its mailbox is open."""
        options = _options(request)
        request_id = options.request_id
        self.traces.begin(request_id, request, metadata)
        outbox = self.core.handle(ev.RequestArrived(options))
        (_, notice), outbox.notices = outbox.notices[0], outbox.notices[1:]
        self.traces.notice(request_id, notice)
        return request_id, notice, outbox

    def open_box(self, request_id: str, box: Mailbox) -> None:
        superseded = self._mailboxes.get(request_id)
        if superseded is not None:  # a resume took the request over: end the old stream
            superseded.put_nowait(CLIENT_GONE)
        self._mailboxes[request_id] = box

    def close_box(self, request_id: str, box: Mailbox) -> None:
        """The stream ended: forget its mailbox and tell the core."""
        if self._mailboxes.get(request_id) is box:  # else a resume owns the request now
            self.traces.closed(request_id)
            del self._mailboxes[request_id]
            # After `done` the core has forgotten the request: nothing to close.
            if self.core.request_state(request_id) is not None:
                self.deliver(self.core.handle(ev.StreamClosed(request_id)))

    @property
    def traces_enabled(self) -> bool:
        return self.traces.enabled

    def to_proto(self, notice: Notice) -> scheduler_pb2.AdmitServerMessage:
        return _to_proto(notice, self.replica)

    async def _read_admit(
        self, request_id: str, context: _AdmitContext, box: asyncio.Queue[object]
    ) -> None:
        """Client messages after the request. EOF is treated as the client
        leaving: a cancelled call looks like a half-close to the reader, and
        the protocol half-closes only after `done`, when nothing is left --
        so `done` itself ends the stream (no read of the half-close: the
        request's last wake-up here)."""
        try:
            while True:
                msg = await _read(context)
                if msg is None:
                    return
                self.on_admit_message(request_id, msg, box)
                if msg.HasField("done"):
                    return
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - a broken read is the client leaving
            log.debug("admit %s: read ended: %r", request_id, exc)
        finally:
            box.put_nowait(CLIENT_GONE)

    def on_admit_message(self, request_id: str, msg: scheduler_pb2.AdmitClientMessage, box: Mailbox) -> None:
        kind = msg.WhichOneof("msg")
        if self._mailboxes.get(request_id) is not box:
            return  # a stream superseded by a resume: the request is not its own any more
        if kind == "first_token":
            self.deliver(self.core.handle(ev.FirstToken(request_id, msg.first_token.seconds_ago)))
        elif kind == "done":
            done = msg.done
            first_ago = done.first_token.seconds_ago if done.HasField("first_token") else None
            self.deliver(self.core.handle(ev.RequestDone(
                request_id, done.finish_reason == "abort", tuple(done.delta_gaps_seconds[:_MAX_GAPS]),
                first_ago, done.prompt_tokens, done.completion_tokens, done.cached_tokens)))
        elif kind == "requeue":
            q = msg.requeue
            self.traces.again(request_id, "requeue", q.prompt_tokens)
            self.deliver(self.core.handle(ev.RequeueRequested(
                request_id, q.prompt_tokens, q.max_tokens, tuple(q.prefix_hashes))))
        elif kind == "replace":
            r = msg.replace
            self.traces.again(request_id, "replace", r.prompt_tokens)
            self.deliver(self.core.handle(ev.ReplaceRequested(
                request_id, tuple(r.exclude_engines), r.prompt_tokens, r.max_tokens,
                tuple(r.prefix_hashes))))
        elif kind == "request":
            box.put_nowait(RejectedInfo(
                RejectReason.INVALID, "one request per Admit stream; open a new stream"))

    # ------------------------------------------------------------ Connect

    async def Connect(
        self, request_iterator: AsyncIterator[scheduler_pb2.EngineMessage], context: _ConnectContext
    ) -> None:
        await self.engine_links.connect(context)

    # ------------------------------------------------------------ WatchQueueHeads

    async def WatchQueueHeads(
        self, request: scheduler_pb2.WatchQueueHeadsRequest,
        context: grpc.aio.ServicerContext[scheduler_pb2.WatchQueueHeadsRequest, scheduler_pb2.QueueHeads],
    ) -> AsyncIterator[scheduler_pb2.QueueHeads]:
        if request.replica == self.replica:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "that is this replica: a scheduler does not watch its own queue heads")
        async for message in self.peer_feed.watch():
            yield message

    # ------------------------------------------------------------ GetState

    async def GetState(
        self,
        request: scheduler_pb2.GetStateRequest,
        context: grpc.aio.ServicerContext[scheduler_pb2.GetStateRequest, scheduler_pb2.SchedulerState],
    ) -> scheduler_pb2.SchedulerState:
        state = _state_proto(self.core.state())
        state.replica = self.replica
        return state

