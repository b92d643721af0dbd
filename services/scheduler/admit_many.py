"""The scheduler's side of `AdmitMany`: a gateway's many Admit streams over
one long-lived call.

Per-call and per-message work dominates a short request's cost in Python
gRPC (BENCHMARKS.md "Short requests"): an Admit call per request costs the
scheduler a handler task, a reader task, three reads, a write and a status.
Here one call carries every request of a gateway: each frame is one message
of one Admit stream (numbered by the gateway), and what a loop turn produces
goes out as one gRPC message.

A stream here means exactly what an Admit call means (grpc_api.py): its
first frame is the `request`; notices reach it through its mailbox
(`_Stream`, which turns each into a frame at once instead of queueing it for
a writer task); `done` ends it (`end` frame, as the call's OK status); the
gateway's `end` frame is the call cancelled -- the lease is kept detached for
a resume, as for a broken call; and when the call ends, every stream on it
ends that way.

Ownership: one `AdmitManyCall` per call. Its handler task writes the frames;
its reader task reads frames and calls the servicer synchronously; both run
on the scheduler's one event loop, like everything touching the core.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol, cast

import grpc

from services.common.many_server import ManyServerCall
from services.common.proto.kvmesh.v1 import scheduler_pb2

from . import events as ev
from .records import Notice, RejectedInfo

__all__ = ["CLIENT_GONE", "AdmitManyCall", "AdmitStreams", "Mailbox"]

log = logging.getLogger(__name__)

# Marks the end of an Admit stream's client side (EOF, cancel, read error, or
# a resume taking the request over), in its mailbox.
CLIENT_GONE = object()


class Mailbox(Protocol):
    """Where the servicer puts an Admit stream's notices (and CLIENT_GONE)."""

    def put_nowait(self, item: object) -> None: ...

    def empty(self) -> bool: ...


class AdmitStreams(Protocol):
    """What an AdmitMany call needs of the servicer (grpc_api.py)."""

    @property
    def traces_enabled(self) -> bool: ...

    def arrive(self, request: scheduler_pb2.AdmitRequest,
               metadata: dict[str, str]) -> tuple[str, Notice, ev.Outbox]: ...

    def open_box(self, request_id: str, box: Mailbox) -> None: ...

    def close_box(self, request_id: str, box: Mailbox) -> None: ...

    def deliver(self, outbox: ev.Outbox) -> None: ...

    def on_admit_message(self, request_id: str, msg: scheduler_pb2.AdmitClientMessage, box: Mailbox) -> None: ...

    def to_proto(self, notice: Notice) -> scheduler_pb2.AdmitServerMessage: ...


class _Stream:
    """One Admit stream on the call, standing in for its mailbox."""

    __slots__ = ("call", "number", "request_id", "open", "sent", "pending_in")

    def __init__(self, call: AdmitManyCall, number: int, request_id: str) -> None:
        self.call = call
        self.number = number
        self.request_id = request_id
        self.open = True
        self.sent = 0       # notices turned into frames
        self.pending_in = -1   # the value of the call's `flushes` its last frame was queued at

    def put_nowait(self, item: object) -> None:
        self.call.put(self, item)

    def empty(self) -> bool:
        """No frame of this stream waits to be written (a Queued update goes
        only into an empty mailbox: see `SchedulerServicer.send_queued_updates`)."""
        return self.pending_in != self.call.flushes


class AdmitManyCall(ManyServerCall):
    """One AdmitMany call (see the module docstring)."""

    def __init__(self, streams: AdmitStreams,
                 context: grpc.aio.ServicerContext[scheduler_pb2.AdmitClientFrames, Any]) -> None:
        super().__init__(context, scheduler_pb2.AdmitServerFrames)
        self._host = streams
        self._open: dict[int, _Stream] = {}
        self._metadata: dict[str, str] = {}
        if streams.traces_enabled:
            metadata = context.invocation_metadata() or ()
            self._metadata = {k: v for k, v in metadata if isinstance(v, str)}

    def streams_open(self) -> bool:
        return bool(self._open)

    def streams_ended(self) -> None:
        for stream in list(self._open.values()):
            self._close(stream)

    def on_frame(self, frame: scheduler_pb2.AdmitClientFrame) -> None:
        stream = self._open.get(frame.stream)
        if stream is None:
            # Stream numbers are never reused: anything but a `request` is a
            # late frame of a stream already ended here.
            if frame.HasField("message") and frame.message.WhichOneof("msg") == "request":
                self._start(frame.stream, frame.message.request)
            return
        if frame.HasField("message"):
            self._host.on_admit_message(stream.request_id, frame.message, stream)
            if stream.open and frame.message.HasField("done"):
                self._send(stream.number, None, end=True)   # ends at done, as an Admit call
                self._close(stream)
        if frame.end and stream.open:
            self._close(stream)   # the gateway ended it: a cancelled call

    def _start(self, number: int, request: scheduler_pb2.AdmitRequest) -> None:
        """An Admit stream's first message (see `SchedulerServicer.Admit`)."""
        request_id, notice, outbox = self._host.arrive(request, self._metadata)
        if isinstance(notice, RejectedInfo):
            # No mailbox: a duplicate id must not take the first stream's.
            self._host.deliver(outbox)
            self._send(number, self._host.to_proto(notice), end=True)
            return
        stream = self._open[number] = _Stream(self, number, request_id)
        self._host.open_box(request_id, stream)
        self._host.deliver(outbox)
        if stream.sent == 0 and stream.open:  # placed on arrival: no Queued first
            self._send(number, self._host.to_proto(notice))
            stream.pending_in = self.flushes

    def put(self, stream: _Stream, item: object) -> None:
        """A notice for `stream` (or CLIENT_GONE: a resume took it over)."""
        if not stream.open:
            return
        if item is CLIENT_GONE:
            self._send(stream.number, None, end=True)
            self._close(stream)
            return
        stream.sent += 1
        stream.pending_in = self.flushes
        rejected = isinstance(item, RejectedInfo)
        # Mailboxes hold notices and the CLIENT_GONE sentinel only.
        self._send(stream.number, self._host.to_proto(cast(Notice, item)), end=rejected)
        if rejected:
            self._close(stream)

    def _send(self, number: int, message: scheduler_pb2.AdmitServerMessage | None, end: bool = False) -> None:
        self.queue(scheduler_pb2.AdmitServerFrame(stream=number, message=message, end=end))

    def _close(self, stream: _Stream) -> None:
        stream.open = False
        self._open.pop(stream.number, None)
        self._host.close_box(stream.request_id, stream)
        self.stream_closed()
