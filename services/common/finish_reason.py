"""Why a generation ended: the one closed set, shared by engine and gateway.

It mirrors kvmesh.v1.FinishReason; the values are OpenAI's names, so a
member is also the string a client sees ("stop", "length", ...). Every
translation to or from it lives here: engine backends name their raw reason
with `parse` (anything unknown -- e.g. vLLM's "repetition" -- is an error),
the engine's gRPC boundary sends `to_proto`, the gateway reads `from_proto`.
`ok` says whether the generation succeeded (a failure before any token
becomes an error answer instead of a finish).
"""

from __future__ import annotations

import enum

from services.common.proto.kvmesh.v1 import common_pb2

__all__ = ["FinishReason"]


class FinishReason(enum.StrEnum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    TIMEOUT = "timeout"
    ERROR = "error"

    @classmethod
    def parse(cls, name: str | None) -> FinishReason:
        """A reason by its name; None or an unknown name is ERROR."""
        if name is None:
            return cls.ERROR
        try:
            return cls(name)
        except ValueError:
            return cls.ERROR

    @classmethod
    def from_proto(cls, value: int) -> FinishReason:
        """kvmesh.v1.FinishReason -> member; unset or unknown is ERROR."""
        return _FROM_PROTO.get(value, cls.ERROR)

    def to_proto(self) -> common_pb2.FinishReason:
        return _TO_PROTO[self]

    @property
    def ok(self) -> bool:
        """The model ended it (a stop or the length limit), not a failure."""
        return self in (FinishReason.STOP, FinishReason.LENGTH)


# Literal table (read-only after import), and its two directions.
_PAIRS: tuple[tuple[common_pb2.FinishReason, FinishReason], ...] = (
    (common_pb2.FINISH_REASON_STOP, FinishReason.STOP),
    (common_pb2.FINISH_REASON_LENGTH, FinishReason.LENGTH),
    (common_pb2.FINISH_REASON_ABORT, FinishReason.ABORT),
    (common_pb2.FINISH_REASON_TIMEOUT, FinishReason.TIMEOUT),
    (common_pb2.FINISH_REASON_ERROR, FinishReason.ERROR),
)
_FROM_PROTO: dict[int, FinishReason] = dict(_PAIRS)
_TO_PROTO: dict[FinishReason, common_pb2.FinishReason] = {member: value for value, member in _PAIRS}
