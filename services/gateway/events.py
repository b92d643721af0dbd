"""What a generation tells its transport: the events of one request's stream.

The driver produces them (`driver.GenerationDriver`; queue positions come
from its `lease_link.LeaseLink`), `event_stream.EventStream` carries them to
the transport, and the transports render them
(`http_api` with `services.common.openai_api` as OpenAI JSON and SSE, `grpc_api` as
`kvmesh.v1.GenerateEvent`). Records only: immutable, no behaviour beyond the
proto mapping of `FinishReason`.

Order on a stream: any number of `QueuedUpdate`, then `TextDelta`s, then one
`Finished` (the last event); `Heartbeat` whenever nothing else was sent for a
while.
"""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from services.common.proto.kvmesh.v1 import common_pb2

__all__ = [
    "Emit",
    "Event",
    "FinishReason",
    "Finished",
    "Heartbeat",
    "QueuedUpdate",
    "TextDelta",
    "Usage",
]


class FinishReason(enum.Enum):
    """Closed set, mirrors kvmesh.v1.FinishReason; values are OpenAI's names."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    TIMEOUT = "timeout"
    ERROR = "error"

    @classmethod
    def from_proto(cls, value: int) -> FinishReason:
        return _FROM_PROTO.get(value, cls.ERROR)

    def to_proto(self) -> common_pb2.FinishReason:
        return _TO_PROTO[self]

    @property
    def ok(self) -> bool:
        return self in (FinishReason.STOP, FinishReason.LENGTH)


_TO_PROTO: dict[FinishReason, common_pb2.FinishReason] = {
    FinishReason.STOP: common_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: common_pb2.FINISH_REASON_LENGTH,
    FinishReason.ABORT: common_pb2.FINISH_REASON_ABORT,
    FinishReason.TIMEOUT: common_pb2.FINISH_REASON_TIMEOUT,
    FinishReason.ERROR: common_pb2.FINISH_REASON_ERROR,
}
# Wire values are plain ints on the way in (an unknown one reads as ERROR).
_FROM_PROTO: dict[int, FinishReason] = {v: k for k, v in _TO_PROTO.items()}


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class QueuedUpdate:
    position: int
    estimated_wait_seconds: float
    priority: int


@dataclass(frozen=True)
class TextDelta:
    text: str
    token_ids: list[int]
    logprobs: list[common_pb2.TokenLogprob] = field(default_factory=list)


@dataclass(frozen=True)
class Finished:
    reason: FinishReason
    usage: Usage
    message: str = ""


@dataclass(frozen=True)
class Heartbeat:
    pass


Event = QueuedUpdate | TextDelta | Finished | Heartbeat
# How the driver hands an event to its stream (heartbeats are the stream's own).
Emit = Callable[[QueuedUpdate | TextDelta | Finished], Awaitable[None]]
