"""What a generation tells its transport: the events of one request's stream.

The driver produces them (`driver.GenerationDriver`; queue positions come
from its `lease_link.LeaseLink`), `event_stream.EventStream` carries them to
the transport, and the transports render them
(`http_api` with `services.common.openai_api` as OpenAI JSON and SSE, `grpc_api` as
`kvmesh.v1.GenerateEvent`). Records only, immutable. `FinishReason` is the
one shared with the engines (services/common/finish_reason.py), re-exported
here because `Finished` carries it.

Order on a stream: any number of `QueuedUpdate`, then `TextDelta`s, then one
`Finished` (the last event; with n > 1 choices, one per choice, interleaved
with the others' deltas, the last `final`); `Heartbeat` whenever nothing else was sent for a
while. A stream that waits again after its first token (preempted, or moving
off a failed engine) sends no `QueuedUpdate`: only heartbeats until its next
`TextDelta`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from services.common.finish_reason import FinishReason
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
    # Resume point: engine deltas relayed on this stream so far, this one
    # included, across engines (the SSE `id: <request_id>.<index>`).
    index: int = 0
    choice: int = 0   # which of the request's n choices (services/gateway/choices.py)


@dataclass(frozen=True)
class Finished:
    reason: FinishReason
    usage: Usage
    message: str = ""
    choice: int = 0
    # The request's last event. With n > 1 each choice ends with its own
    # `Finished`; only the last is final, and its usage is the request's.
    final: bool = True


@dataclass(frozen=True)
class Heartbeat:
    pass


Event = QueuedUpdate | TextDelta | Finished | Heartbeat
# How the driver hands an event to its stream (heartbeats are the stream's own).
Emit = Callable[[QueuedUpdate | TextDelta | Finished], Awaitable[None]]
