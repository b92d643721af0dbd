"""The gateway's client of the scheduler: its channel (`SchedulerClient`) and
one bidi `Scheduler.Admit` stream per request (`AdmitSession`).

The lease lives exactly as long as the stream, so every path out of a request
ends the call: `report_done` + `close` (done + half-close, then wait briefly
for the scheduler to end it) or `cancel` (at once: client gone, request
failed). What a request does with its stream over its life (re-admission,
re-attachment after a scheduler restart) is `lease_link.LeaseLink`'s.

Error boundary: gRPC status codes from the scheduler become domain errors here
and nowhere else (through `errors.from_scheduler_rpc_error` /
`errors.from_rejection`). An unreachable scheduler that answered this gateway
before raises the subclass `errors.SchedulerRestarting`: a restart to wait
out, not a misconfiguration to report at once.

Reading: until the request first runs on an engine, its task reads the stream
itself (`next_outcome`: the TTFT path has no hop). From `listen()` on, ONE
reader task reads it -- the request's task is busy reading its engine then,
and a pending grpc.aio read must never be cancelled (that cancels the call)
-- and hands a `preempted` straight to a callback, everything else to
`next_outcome` through an inbox.

Ownership: the `SchedulerClient` belongs to the gateway service and, with it,
the one fact shared by all requests: whether the scheduler has ever answered
(`Reachability`, set when the channel is READY or a stream gets an answer).
Each `AdmitSession` is used by one task only (its request's pump), plus the
session's own reader task after `listen()`, which only reads.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import grpc

from services.common.grpc_server import client_options
from services.common.mesh_tls import MeshIdentity, aio_channel
from services.common.proto.kvmesh.v1 import scheduler_pb2, scheduler_pb2_grpc
from services.gateway.admit_many import AdmitMany, ManyStream
from services.gateway.call_ending import CallEnder
from services.gateway.errors import GatewayError, SchedulerRestarting, from_rejection, from_scheduler_rpc_error
from services.gateway.spare_calls import SpareCall

__all__ = ["AdmitSession", "Reachability", "SchedulerClient"]

log = logging.getLogger(__name__)

# After `done` + half-close, how long to wait for the scheduler to end the
# stream before cancelling it ourselves (either way the lease is released).
_CLOSE_GRACE_SECONDS = 2.0

_Inbound = scheduler_pb2.AdmitServerMessage | GatewayError

_WITHDRAWN = scheduler_pb2.AdmitClientMessage(done=scheduler_pb2.RequestDone(finish_reason="abort"))


@dataclass
class Reachability:
    """Whether the scheduler has answered this gateway since it started (its
    channel was READY, or an Admit stream got a message). From then on an
    unreachable scheduler is a restart to wait out (re-admit with backoff),
    not a misconfiguration to report at once."""

    answered: bool = False

    def unreachable(self, err: grpc.RpcError | None) -> GatewayError:
        """The error for a stream that failed or ended without an answer."""
        exc = from_scheduler_rpc_error(err)
        return SchedulerRestarting.of(exc) if self.answered else exc


class AdmitSession:
    """One request's Admit stream. Used by one task only (the driver's)."""

    def __init__(self, call: grpc.aio.StreamStreamCall | ManyStream, reachability: Reachability,
                 ender: CallEnder) -> None:
        self._call = call
        self._ender = ender
        self._finished = False
        self._reachability = reachability
        # After `listen()`: the reader task, what it read for `next_outcome`
        # (ending with a GatewayError or None at the stream's end), and who
        # is told of a `preempted`.
        self._reader: asyncio.Task[None] | None = None
        self._inbox: asyncio.Queue[_Inbound | None] = asyncio.Queue()
        self._on_preempted: Callable[[scheduler_pb2.Preempted], None] | None = None
        # The scheduler replica it is open on (scheduler_replicas.py; "" = the one).
        self.replica = ""
        # The scheduler said it ends the stream at `done` (Placed.ends_at_done).
        self._ends_at_done = False

    @property
    def broken(self) -> bool:
        """The stream ended while still in use (the scheduler went away)."""
        return self._call.done() and not self._finished

    def on_broken(self, callback: Callable[[], None]) -> None:
        """Call `callback` (on the event loop) when the stream ends while
        still in use -- a scheduler restart -- and not because this side
        finished or cancelled it. Event-driven: no read is left pending
        (cancelling a pending grpc.aio read would cancel the whole call)."""

        def fire(_call: object) -> None:
            if not self._finished:
                callback()

        self._call.add_done_callback(fire)

    async def send_request(self, request: scheduler_pb2.AdmitRequest) -> None:
        await self._write(scheduler_pb2.AdmitClientMessage(request=request))

    async def _write(self, message: scheduler_pb2.AdmitClientMessage) -> None:
        """Write a message the lease depends on; a broken stream raises."""
        try:
            await self._call.write(message)
        except grpc.aio.AioRpcError as exc:
            raise self._reachability.unreachable(exc) from exc
        except asyncio.InvalidStateError as exc:  # call already over
            raise self._reachability.unreachable(None) from exc

    def listen(self, on_preempted: Callable[[scheduler_pb2.Preempted], None]) -> None:
        """From now on the reader task reads the stream: a `preempted` calls
        `on_preempted` at once (from that task), anything else waits for
        `next_outcome`. Later calls only change the callback."""
        self._on_preempted = on_preempted
        if self._reader is None:
            self._reader = asyncio.get_running_loop().create_task(self._read_all(), name="admit-reader")

    async def _read_all(self) -> None:
        while True:
            try:
                message = await self._read()
            except GatewayError as exc:
                self._inbox.put_nowait(exc)
                return
            if message is None:
                self._inbox.put_nowait(None)
                return
            if message.WhichOneof("msg") == "preempted":
                if self._on_preempted is not None:
                    self._on_preempted(message.preempted)
                continue
            self._inbox.put_nowait(message)

    async def _read(self) -> scheduler_pb2.AdmitServerMessage | None:
        """The next message; None at the stream's end; a failed stream raises."""
        try:
            read = await self._call.read()
        except grpc.aio.AioRpcError as exc:
            raise self._reachability.unreachable(exc) from exc
        if read is grpc.aio.EOF:
            return None
        self._reachability.answered = True
        return cast(scheduler_pb2.AdmitServerMessage, read)  # grpc.aio types reads as object

    async def next_outcome(self) -> scheduler_pb2.Queued | scheduler_pb2.Placed:
        """The next `queued` or `placed`; a `rejected` or a broken stream raises."""
        while True:
            if self._reader is None:
                message = await self._read()
            else:
                inbound = await self._inbox.get()
                if isinstance(inbound, GatewayError):
                    self._inbox.put_nowait(inbound)  # the stream stays broken
                    raise inbound
                message = inbound
            if message is None:
                if self._reader is not None:
                    self._inbox.put_nowait(None)
                raise self._reachability.unreachable(None)
            kind = message.WhichOneof("msg")
            if kind == "queued":
                return message.queued
            if kind == "placed":
                self._ends_at_done = message.placed.ends_at_done
                return message.placed
            if kind == "rejected":
                raise from_rejection(message.rejected)
            # `preempted` here is stale: the request was not running.
            log.warning("ignoring Admit message %r", kind)

    async def first_token(self, seconds_ago: float = 0.0) -> None:
        await self._send(scheduler_pb2.AdmitClientMessage(
            first_token=scheduler_pb2.FirstToken(seconds_ago=seconds_ago)))

    async def replace(
        self, exclude: list[str], prompt_tokens: int, max_tokens: int, prefix_hashes: list[int]
    ) -> None:
        message = scheduler_pb2.AdmitClientMessage(
            replace=scheduler_pb2.Replace(
                exclude_engines=exclude,
                prompt_tokens=prompt_tokens,
                max_tokens=max_tokens,
                prefix_hashes=prefix_hashes,
            )
        )
        await self._write(message)

    async def requeue(self, prompt_tokens: int, max_tokens: int, prefix_hashes: list[int]) -> None:
        """Answer `preempted`: the request, as it stands now, waits again."""
        message = scheduler_pb2.AdmitClientMessage(
            requeue=scheduler_pb2.Requeue(
                prompt_tokens=prompt_tokens, max_tokens=max_tokens, prefix_hashes=prefix_hashes)
        )
        await self._write(message)

    async def report_done(self, done: scheduler_pb2.RequestDone) -> None:
        """Send the outcome and half-close (cheap: no round trip). Call
        `close()` afterwards to release the stream."""
        if self._finished:
            return
        self._finished = True
        self._on_preempted = None  # a `preempted` crossing `done` is moot
        with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
            await self._call.write(scheduler_pb2.AdmitClientMessage(done=done))
            if not self._ends_at_done:   # a scheduler that waits for the half-close
                await self._call.done_writing()

    async def close(self) -> None:
        """Let the scheduler end the stream (bounded wait), then make sure it is over."""
        try:
            async with asyncio.timeout(_CLOSE_GRACE_SECONDS):
                if self._reader is not None:
                    await asyncio.wait([self._reader])  # it reads to the end
                else:
                    while await self._call.read() is not grpc.aio.EOF:
                        pass
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError, TimeoutError):
            pass  # the lease ends with the stream either way
        finally:
            self._call.cancel()

    def withdraw(self, first_token_ago: float | None = None) -> None:
        """End the stream on purpose (the request failed or its client left):
        `done` first, in the background, so the scheduler releases the lease
        at once instead of keeping it for a resume (a stream that just breaks).
        `first_token_ago`: a first token not told yet goes with it."""
        if self._finished or self._call.done():
            self.cancel()
            return
        self._finished = True
        self._on_preempted = None
        last = _WITHDRAWN
        if first_token_ago is not None:
            last = scheduler_pb2.AdmitClientMessage(done=scheduler_pb2.RequestDone(
                finish_reason="abort", first_token=scheduler_pb2.FirstToken(seconds_ago=first_token_ago)))
        # The scheduler ends the stream once it has read `done`.
        self._ender.end_after(self._call, last, wait_end=True)

    def cancel(self) -> None:
        """End the stream now: the scheduler drops the queue entry, and keeps
        a lease detached for a resume (detached_leases.py)."""
        self._finished = True
        self._on_preempted = None
        self._call.cancel()

    async def _send(self, message: scheduler_pb2.AdmitClientMessage) -> None:
        # Progress reports are advisory: a scheduler that went away must not
        # break a stream that is generating fine on its engine.
        with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
            await self._call.write(message)


class SchedulerClient:
    """Owns the gateway's channel to the scheduler."""

    def __init__(self, address: str, identity: MeshIdentity | None = None,
                 reachability: Reachability | None = None, answer_seconds: float = 0.0,
                 on_silent: Callable[[], None] | None = None) -> None:
        """`reachability`: shared by the replicas of one gateway
        (scheduler_replicas.py): once any answered, an unreachable one is a
        restart to wait out (or to move away from). `answer_seconds` > 0:
        the AdmitMany call fails when the scheduler owes an answer and says
        nothing that long, and `on_silent` is told (many_call.py)."""
        self.address = address
        self.channel = aio_channel(
            address, identity, "scheduler",
            [
                *client_options(),
                # Stay connected: /health and gRPC health follow this channel.
                ("grpc.client_idle_timeout_ms", 2**31 - 1),
                ("grpc.initial_reconnect_backoff_ms", 200),
                ("grpc.max_reconnect_backoff_ms", 2000),
                # A replica's address may be a DNS name (a StatefulSet pod's,
                # kvmesh-scheduler-1.kvmesh-scheduler) that moves to a new IP
                # when its pod is replaced: once the old connection breaks,
                # look the name up again within a second, not gRPC's default
                # 30 s between resolutions (as engine_client.py does).
                ("grpc.dns_min_time_between_resolutions_ms", 1000),
            ],
        )
        self._stub = scheduler_pb2_grpc.SchedulerStub(self.channel)
        self._ender = CallEnder()
        self._spare = SpareCall(self._stub.Admit)
        # Admit streams over one call once the scheduler answered it (admit_many.py).
        self._many = AdmitMany(self._stub.AdmitMany, answer_seconds, on_silent)
        self._reachability = reachability or Reachability()

    def is_ready(self) -> bool:
        return self.channel.get_state(try_to_connect=True) == grpc.ChannelConnectivity.READY

    def unanswered_for(self) -> float:
        """Seconds a request has waited for the scheduler's first answer with
        nothing heard from it since (0 when the AdmitMany call is unwatched)."""
        return self._many.unanswered_for()

    async def wait_ready_change(self, last: grpc.ChannelConnectivity) -> grpc.ChannelConnectivity:
        await self.channel.wait_for_state_change(last)
        state = self.channel.get_state(try_to_connect=True)
        if state == grpc.ChannelConnectivity.READY:
            self._reachability.answered = True
        return state

    async def open(self, request: scheduler_pb2.AdmitRequest) -> AdmitSession:
        # Fail fast (no wait_for_ready): an unreachable scheduler is a 503 now,
        # not a hang. A restart while queued is re-admitted by the driver.
        self._many.ensure()
        session = AdmitSession(self._many.stream() or self._spare.take(), self._reachability, self._ender)
        try:
            await session.send_request(request)
        except BaseException:  # GatewayError, or the request's task cancelled
            session.cancel()
            raise
        return session

    def replenish(self) -> None:
        """Open the next request's Admit stream now (see `SpareCall`),
        unless requests go over AdmitMany."""
        self._many.ensure()
        if not self._many.ready:
            self._spare.replenish()

    async def get_state(self, timeout: float) -> scheduler_pb2.SchedulerState | None:
        try:
            return await self._stub.GetState(scheduler_pb2.GetStateRequest(), timeout=timeout)
        except grpc.aio.AioRpcError:
            return None

    async def close(self) -> None:
        self._spare.discard()
        self._many.close()
        await self.channel.close()
