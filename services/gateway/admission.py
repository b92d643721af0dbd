"""Client side of `Scheduler.Admit`: one bidi stream per request.

The lease lives exactly as long as the stream, so every path out of a request
ends the call: `finish` (done + half-close, then wait briefly for the
scheduler to end it) or `cancel` (at once: client gone, request failed).
gRPC status codes from the scheduler become domain errors here and nowhere
else (through `errors.from_scheduler_rpc_error` / `errors.from_rejection`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

import grpc

from services.common.grpc_server import client_options
from services.common.mesh_tls import MeshIdentity, aio_channel
from services.common.proto.kvmesh.v1 import scheduler_pb2, scheduler_pb2_grpc
from services.gateway.errors import GatewayError, from_rejection, from_scheduler_rpc_error
from services.gateway.spare_calls import SpareCall

__all__ = ["AdmissionClient", "AdmitSession"]

log = logging.getLogger(__name__)

# After `done` + half-close, how long to wait for the scheduler to end the
# stream before cancelling it ourselves (either way the lease is released).
_CLOSE_GRACE_SECONDS = 2.0


class AdmitSession:
    """One request's Admit stream. Used by one task only (the driver's)."""

    def __init__(self, call: grpc.aio.StreamStreamCall, on_answer: Callable[[], None] | None = None) -> None:
        self._call = call
        self._finished = False
        self._on_answer = on_answer

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
        try:
            await self._call.write(scheduler_pb2.AdmitClientMessage(request=request))
        except grpc.aio.AioRpcError as exc:
            raise from_scheduler_rpc_error(exc) from exc
        except asyncio.InvalidStateError as exc:  # call already over
            raise from_scheduler_rpc_error(None) from exc

    async def next_outcome(self) -> scheduler_pb2.Queued | scheduler_pb2.Placed:
        """The next `queued` or `placed`; a `rejected` or a broken stream raises."""
        while True:
            try:
                message = await self._call.read()
            except grpc.aio.AioRpcError as exc:
                raise from_scheduler_rpc_error(exc) from exc
            if message is grpc.aio.EOF:
                raise from_scheduler_rpc_error(None)
            if self._on_answer is not None:
                self._on_answer()
                self._on_answer = None
            kind = message.WhichOneof("msg")
            if kind == "queued":
                return message.queued
            if kind == "placed":
                return message.placed
            if kind == "rejected":
                raise from_rejection(message.rejected)
            log.warning("ignoring unknown Admit message %r", kind)

    async def first_token(self) -> None:
        await self._send(scheduler_pb2.AdmitClientMessage(first_token=scheduler_pb2.FirstToken()))

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
        try:
            await self._call.write(message)
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as exc:
            raise from_scheduler_rpc_error(exc if isinstance(exc, grpc.aio.AioRpcError) else None) from exc

    async def report_done(self, done: scheduler_pb2.RequestDone) -> None:
        """Send the outcome and half-close (cheap: no round trip). Call
        `close()` afterwards to release the stream."""
        if self._finished:
            return
        self._finished = True
        with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
            await self._call.write(scheduler_pb2.AdmitClientMessage(done=done))
            await self._call.done_writing()

    async def close(self) -> None:
        """Let the scheduler end the stream (bounded wait), then make sure it is over."""
        try:
            async with asyncio.timeout(_CLOSE_GRACE_SECONDS):
                while await self._call.read() is not grpc.aio.EOF:
                    pass
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError, TimeoutError):
            pass  # the lease ends with the stream either way
        finally:
            self._call.cancel()

    def cancel(self) -> None:
        """End the stream now: the scheduler drops the queue entry or lease."""
        self._finished = True
        self._call.cancel()

    async def _send(self, message: scheduler_pb2.AdmitClientMessage) -> None:
        # Progress reports are advisory: a scheduler that went away must not
        # break a stream that is generating fine on its engine.
        with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
            await self._call.write(message)


class AdmissionClient:
    """Owns the gateway's channel to the scheduler."""

    def __init__(self, address: str, identity: MeshIdentity | None = None) -> None:
        self.address = address
        self.channel = aio_channel(
            address, identity, "scheduler",
            [
                *client_options(),
                # Stay connected: /health and gRPC health follow this channel.
                ("grpc.client_idle_timeout_ms", 2**31 - 1),
                ("grpc.initial_reconnect_backoff_ms", 200),
                ("grpc.max_reconnect_backoff_ms", 2000),
            ],
        )
        self._stub = scheduler_pb2_grpc.SchedulerStub(self.channel)
        self._spare = SpareCall(self._stub.Admit)
        # True once the scheduler was reachable (channel READY, or an Admit
        # stream got an answer): from then on an unreachable scheduler is a
        # restart to wait out (re-admit with backoff), not a misconfiguration
        # to report at once.
        self.answered = False

    def _mark_answered(self) -> None:
        self.answered = True

    def is_ready(self) -> bool:
        return self.channel.get_state(try_to_connect=True) == grpc.ChannelConnectivity.READY

    async def wait_ready_change(self, last: grpc.ChannelConnectivity) -> grpc.ChannelConnectivity:
        await self.channel.wait_for_state_change(last)
        state = self.channel.get_state(try_to_connect=True)
        if state == grpc.ChannelConnectivity.READY:
            self.answered = True
        return state

    async def open(self, request: scheduler_pb2.AdmitRequest) -> AdmitSession:
        # Fail fast (no wait_for_ready): an unreachable scheduler is a 503 now,
        # not a hang. A restart while queued is re-admitted by the driver.
        session = AdmitSession(self._spare.take(), self._mark_answered)
        try:
            await session.send_request(request)
        except GatewayError:
            session.cancel()
            raise
        return session

    def replenish(self) -> None:
        """Open the next request's Admit stream now (see `SpareCall`)."""
        self._spare.replenish()

    async def get_state(self, timeout: float) -> scheduler_pb2.SchedulerState | None:
        try:
            return await self._stub.GetState(scheduler_pb2.GetStateRequest(), timeout=timeout)
        except grpc.aio.AioRpcError:
            return None

    async def close(self) -> None:
        self._spare.discard()
        await self.channel.close()
