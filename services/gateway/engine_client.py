"""Client side of `Engine.Generate`, with one cached channel per engine address.

A request's stream is a stream of the gateway's one `GenerateMany` call to
its engine once that call is up (generate_many.py), else a Generate call of
its own; `EngineStream` means the same on both.

Ownership: the `EnginePool` belongs to the gateway service; channels are
created on first use from the event loop and closed in `close()`. Status
codes from an engine become domain errors here (through
`errors.classify_engine_rpc_error`): a request fault (INVALID_ARGUMENT...)
is the client's error, anything else is an `EngineFailure` the driver may
migrate away from. A stream the gateway stopped itself (`EngineStream.stop`,
a preemption) raises `EngineStopped` instead, in the task reading it.

Ending a call on purpose always says `cancel` first (`cancel`, `stop`,
`abort`): the engine then ends the generation at once. A call that just
breaks -- this gateway died, or `detach` -- leaves the generation detached
on the engine for a resume (services/engine/detached.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import cast

import grpc

from services.common.grpc_server import client_options
from services.common.mesh_tls import MeshIdentity, aio_channel
from services.common.proto.kvmesh.v1 import engine_pb2, engine_pb2_grpc
from services.gateway.call_ending import CallEnder
from services.gateway.errors import EngineFailure, EngineStopped, classify_engine_rpc_error
from services.gateway.generate_many import GenerateMany
from services.gateway.many_call import ManyStream
from services.gateway.spare_calls import SpareCall

__all__ = ["EnginePool", "EngineStream"]

# HTTP/2 flow control on engine streams: a fixed 64 KiB window per stream (no
# BDP growth). Token deltas are tiny, so a window grown to megabytes would
# park tens of thousands of per-step deltas in gRPC's buffers for a slow
# reader; a small window stalls the engine's writes instead, and the engine
# coalesces everything after that into the next delta (DESIGN: backpressure
# by coalescing). 64 KiB per stream is still far above any token rate.
_FLOW_OPTIONS = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 64 * 1024)]

_CANCEL = engine_pb2.EngineGenerateMessage(cancel=engine_pb2.CancelGeneration())
# Closing a finished call: the engine reads the acknowledgement and ends it.
_ACK_SECONDS = 1.0


class EngineStream:
    """One Generate call. Cancelling it (or the task reading it) aborts the
    generation in the engine at once."""

    def __init__(self, call: grpc.aio.StreamStreamCall | ManyStream, engine_id: str, ender: CallEnder) -> None:
        self._call = call
        self._ender = ender
        self.engine_id = engine_id
        # Set by `stop()`: the call was cancelled on purpose, from outside.
        self._stopped = False
        # `cancel` was (or is being) written: the engine ends the generation.
        self._said_cancel = False
        # The call ender writes `cancel`, then ends the call.
        self._ending = False

    async def start(self, request: engine_pb2.EngineRequest) -> None:
        await self._send_first(engine_pb2.EngineGenerateMessage(request=request))

    async def resume(self, request_id: str, prompt: list[int], trace_context: tuple[tuple[str, str], ...] = ()) -> None:
        """Re-attach to a generation the engine kept (its first event is `resumed`)."""
        await self._send_first(engine_pb2.EngineGenerateMessage(
            resume=engine_pb2.ResumeGeneration(request_id=request_id, prompt_token_ids=prompt,
                                               trace_context=dict(trace_context) if trace_context else None)))

    async def _send_first(self, message: engine_pb2.EngineGenerateMessage) -> None:
        try:
            await self._call.write(message)
        except (asyncio.CancelledError, asyncio.InvalidStateError, grpc.aio.AioRpcError) as exc:
            self._raise_if_stopped(exc)
            if isinstance(exc, grpc.aio.AioRpcError):
                raise classify_engine_rpc_error(exc, self.engine_id) from exc
            if isinstance(exc, asyncio.InvalidStateError):
                raise EngineFailure(
                    self.engine_id, f"engine {self.engine_id}: stream closed before the request") from exc
            raise

    def _stopped_here(self) -> bool:
        """Did `stop()` cancel the call -- and is the calling task itself not
        being cancelled? (A cancelled call's reads and writes raise
        CancelledError in grpc.aio, like a cancelled task.)"""
        task = asyncio.current_task()
        return self._stopped and not (task is not None and task.cancelling())

    def _raise_if_stopped(self, exc: BaseException) -> None:
        """A read or write failed because `stop()` cancelled the call: that
        is `EngineStopped`."""
        if self._stopped_here():
            raise EngineStopped(self.engine_id) from exc

    async def events(self) -> AsyncIterator[engine_pb2.EngineGenerateEvent]:
        """Deltas, then one `finished`. A stream that ends without `finished`
        is an engine failure, never a clean end."""
        while True:
            try:
                read = await self._call.read()
            except (asyncio.CancelledError, grpc.aio.AioRpcError) as exc:
                self._raise_if_stopped(exc)
                if isinstance(exc, grpc.aio.AioRpcError):
                    raise classify_engine_rpc_error(exc, self.engine_id) from exc
                raise
            if read is grpc.aio.EOF:
                if self._stopped:
                    raise EngineStopped(self.engine_id)
                raise EngineFailure(self.engine_id, f"engine {self.engine_id} ended the stream without finishing")
            if self._stopped:  # read after `stop()`: dropped (the driver keeps what it relayed)
                raise EngineStopped(self.engine_id)
            event = cast(engine_pb2.EngineGenerateEvent, read)  # grpc.aio types reads as object
            yield event
            if event.HasField("finished"):
                return

    async def abort(self) -> None:
        """Polite cancel (a `cancel` message) then end the call."""
        try:
            async with asyncio.timeout(0.5):
                await self._call.write(_CANCEL)
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
            pass
        except asyncio.CancelledError:
            if not self._stopped_here():
                raise
        self._call.cancel()

    async def say_cancel(self) -> None:
        """Write `cancel` now (bounded), leaving the call open: whoever ends
        the call afterwards (even bare) no longer leaves the generation kept."""
        if self._said_cancel or self._call.done():
            return
        self._said_cancel = True
        try:
            async with asyncio.timeout(0.5):
                await self._call.write(_CANCEL)
        except Exception:  # noqa: BLE001 - a call already broken or busy
            pass

    def cancel(self) -> None:
        """End the call now, saying `cancel` first (in the background)."""
        if self._call.done() or self._ending:
            # Already being ended: cancelling the call now would cut the
            # pending `cancel` write (a preemption's `stop` then the driver's
            # `cancel`), and the engine would keep the generation for a
            # resume -- refusing the request's next placement there as a
            # duplicate while it runs on.
            return
        if self._said_cancel:
            self._call.cancel()
            return
        self._said_cancel = self._ending = True
        self._ender.end_after(self._call, _CANCEL)

    def detach(self) -> None:
        """End the call WITHOUT `cancel`: the engine keeps the generation
        for a resume (a draining gateway leaving its streams resumable)."""
        self._call.cancel()

    def stop(self) -> None:
        """Stop the generation now, from outside the task reading the stream
        (the request was preempted): the engine aborts it and frees its KV;
        the reader's pending or next `events()` read (or `start`) raises
        `EngineStopped`. What was read before stays the caller's."""
        self._stopped = True
        self.cancel()

    async def close(self) -> None:
        """After `finished` reached the client: acknowledge it (a `cancel`,
        a no-op for a finished generation; until then the engine keeps it
        for a resume: EngineRequest.ack_final) and let the call end: the
        engine ends it once it has read the acknowledgement, so no
        half-close is sent (one gRPC operation less per request).
        Marks `cancel` said: a transport closing meanwhile (`say_cancel`)
        must not write on the ending call -- such a write never returned,
        and the request's in-flight count with it (a draining gateway waited
        its whole bound). A call already ended (aborted, failed, migrated
        away from) has nothing to acknowledge."""
        if self._call.done():
            return
        self._said_cancel = True
        try:
            async with asyncio.timeout(_ACK_SECONDS):
                await self._call.write(_CANCEL)
                await self._call.code()
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError, TimeoutError):
            pass
        except asyncio.CancelledError:
            if not self._stopped_here():
                raise
        finally:
            self._call.cancel()


class EnginePool:
    def __init__(self, identity: MeshIdentity | None = None) -> None:
        self._identity = identity  # mesh TLS: engines must prove they are engines
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._stubs: dict[str, engine_pb2_grpc.EngineStub] = {}
        self._spares: dict[str, SpareCall] = {}
        # Generate streams over one call per engine once it answered it
        # (generate_many.py); per-request calls (spares) until then.
        self._many: dict[str, GenerateMany] = {}
        self._ender = CallEnder()

    def _stub(self, address: str) -> engine_pb2_grpc.EngineStub:
        stub = self._stubs.get(address)
        if stub is None:
            # Short reconnect backoff: an engine restarted on the same address
            # must be usable within a second or two, not after gRPC's default
            # backoff (which grows to two minutes).
            channel = aio_channel(address, self._identity, "engine", [
                *client_options(),
                ("grpc.initial_reconnect_backoff_ms", 100),
                ("grpc.min_reconnect_backoff_ms", 100),
                ("grpc.max_reconnect_backoff_ms", 1000),
                # An engine address may be a DNS name (a StatefulSet pod's)
                # that moves to a new IP when the pod is rescheduled: once the
                # old connection breaks, look the name up again within a
                # second, not gRPC's default 30 s between resolutions.
                ("grpc.dns_min_time_between_resolutions_ms", 1000),
                *_FLOW_OPTIONS,
            ])
            self._channels[address] = channel
            stub = self._stubs[address] = engine_pb2_grpc.EngineStub(channel)
        return stub

    def many(self, address: str) -> GenerateMany:
        """The GenerateMany call to `address`, opened in the background
        unless it is up or was tried too lately."""
        many = self._many.get(address)
        if many is None:
            many = self._many[address] = GenerateMany(self._stub(address).GenerateMany)
        many.ensure()
        return many

    def open(self, address: str, engine_id: str) -> EngineStream:
        """A Generate stream to `address`: on its GenerateMany call once
        that is up, else a Generate call (the spare one if it is alive). No
        deadline on the call: the driver bounds the generation itself."""
        stream = self.many(address).stream()
        if stream is not None:
            return EngineStream(stream, engine_id, self._ender)
        spare = self._spares.get(address)
        if spare is None:
            spare = self._spares[address] = SpareCall(self._stub(address).Generate)
        return EngineStream(spare.take(), engine_id, self._ender)

    def replenish(self, address: str) -> None:
        """Open the next Generate call to `address` now (see `SpareCall`),
        unless requests go over GenerateMany."""
        many = self._many.get(address)
        if many is not None and many.ready:
            return
        spare = self._spares.get(address)
        if spare is not None:
            spare.replenish()

    async def close(self) -> None:
        for spare in self._spares.values():
            spare.discard()
        self._spares.clear()
        for many in self._many.values():
            many.close()
        self._many.clear()
        channels = list(self._channels.values())
        self._channels.clear()
        self._stubs.clear()
        for channel in channels:
            await channel.close()
