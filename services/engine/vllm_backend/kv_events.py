"""Subscriber to vLLM's ZMQ KV-event publisher, with gap detection.

Wire format (vllm/distributed/kv_events.py, ZmqEventPublisher): multipart
(topic, seq as 8-byte big-endian, msgpack(KVEventBatch)); seq counts batches
from 0. The replay socket (ROUTER) answers a request carrying a start seq
with every buffered (topic, seq, payload) from there, then an END_SEQ (-1)
frame.

Our SUB socket *binds* on loopback and vLLM's PUB *connects* to it (vLLM
connects whenever its endpoint has no wildcard): no port race, and a
connecting PUB queues messages from the start, so the first batch is seq 0.
On a gap the missing batches are replayed; if the replay cannot fill it the
translator is cleared (reported as `cleared`) and rebuilds from later events.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from services.engine.vllm_backend.kv_translate import KvDelta, KvTranslator

__all__ = ["KvEventSubscriber"]

log = logging.getLogger("kvmesh.engine.vllm.kv")

_END_SEQ = -1
# A replay answers from an in-memory buffer over a local socket: a second is
# plenty; past it we fall back to clearing.
_REPLAY_TIMEOUT_MS = 1000


class KvEventSubscriber:
    """Receives vLLM's event batches and hands translated deltas to `sink`."""

    def __init__(
        self,
        sink: Callable[[KvDelta], None],
        batch_type: type,
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        self._translator: KvTranslator | None = None
        self._sink = sink
        self._decoder: msgspec.msgpack.Decoder[Any] = msgspec.msgpack.Decoder(type=batch_type)
        self._ctx = zmq.asyncio.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.setsockopt(zmq.RCVHWM, 0)  # never drop on our side: the gap logic is a fallback
        if port:
            self._sub.bind(f"tcp://{host}:{port}")
            self.port = port
        else:
            self.port = self._sub.bind_to_random_port(f"tcp://{host}")
        self.endpoint = f"tcp://{host}:{self.port}"
        self.replay_endpoint: str | None = None
        self._next_seq = 0
        self._task: asyncio.Task[None] | None = None
        self.gaps = 0
        self.batches = 0
        self._waiters: list[tuple[int, asyncio.Future[None]]] = []

    def start(self, translator: KvTranslator, replay_endpoint: str | None) -> None:
        """Start applying batches (those vLLM sent before this wait in ZMQ)."""
        self._translator = translator
        self.replay_endpoint = replay_endpoint
        self._task = asyncio.get_running_loop().create_task(self._run(), name="vllm-kv-events")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self._sub.close(linger=0)
        self._ctx.term()

    @property
    def next_seq(self) -> int:
        return self._next_seq

    async def wait_for_seq(self, seq: int, timeout: float) -> None:
        """Wait until batch `seq` has been applied (tests, resync)."""
        if self._next_seq > seq:
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append((seq, fut))
        await asyncio.wait_for(fut, timeout)

    async def _run(self) -> None:
        while True:
            try:
                frames = await self._sub.recv_multipart()
            except zmq.ZMQError as exc:
                if exc.errno == zmq.ETERM:
                    return
                raise
            if len(frames) != 3:
                log.warning("kv events: ignoring malformed message of %d frames", len(frames))
                continue
            _, seq_bytes, payload = frames
            seq = int.from_bytes(seq_bytes, "big", signed=True)
            if seq < self._next_seq:
                continue  # already applied (replayed earlier)
            if seq > self._next_seq:
                self.gaps += 1
                log.warning("kv events: gap, expected seq %d got %d", self._next_seq, seq)
                if not await self._replay(self._next_seq, seq):
                    self._sink(self._require_translator().clear())
            self._apply(seq, payload)

    def _require_translator(self) -> KvTranslator:
        if self._translator is None:
            raise RuntimeError("KvEventSubscriber.start() was not called")
        return self._translator

    def _apply(self, seq: int, payload: bytes) -> None:
        translator = self._require_translator()
        try:
            batch = self._decoder.decode(payload)
        except msgspec.DecodeError:
            log.exception("kv events: undecodable batch %d; clearing", seq)
            delta = translator.clear()
        else:
            delta = translator.apply(batch.events)
        self._next_seq = seq + 1
        self.batches += 1
        if not delta.empty():
            self._sink(delta)
        self._wake()

    def _wake(self) -> None:
        still: list[tuple[int, asyncio.Future[None]]] = []
        for seq, fut in self._waiters:
            if self._next_seq > seq:
                if not fut.done():
                    fut.set_result(None)
            elif not fut.done():
                still.append((seq, fut))
        self._waiters = still

    async def _replay(self, start: int, end: int) -> bool:
        """Apply batches [start, end) from vLLM's replay buffer; False if it
        could not deliver all of them."""
        if self.replay_endpoint is None:
            return False
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(self.replay_endpoint)
            await sock.send_multipart((b"", start.to_bytes(8, "big")))
            while True:
                if not await sock.poll(_REPLAY_TIMEOUT_MS):
                    log.warning("kv events: replay from %d timed out", start)
                    return False
                frames: list[Any] = await sock.recv_multipart()
                # (b"", topic, seq, payload); END_SEQ ends the answer.
                if len(frames) != 4:
                    log.warning("kv events: bad replay answer of %d frames", len(frames))
                    return False
                seq = int.from_bytes(frames[2], "big", signed=True)
                if seq == _END_SEQ:
                    return self._next_seq >= end
                if seq < self._next_seq or seq >= end:
                    continue  # applied already / the live stream delivers it next
                if seq > self._next_seq:
                    return False  # the buffer no longer holds what we missed
                self._apply(seq, frames[3])
        finally:
            sock.close(linger=0)
