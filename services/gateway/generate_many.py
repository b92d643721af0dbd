"""The gateway's side of `Engine.GenerateMany`: its requests' Generate
streams over one long-lived call per engine (many_call.py has how).

`ManyStream` stands in for a Generate call in `EngineStream`: read returns
the engine's events, then EOF once the engine ended the stream OK; raises
the AioRpcError the Generate call would have ended with (the stream's
`status`: classify_engine_rpc_error reads it as before) or the call's when
the call failed -- which leaves the generation detached on the engine, as a
broken Generate call does; CancelledError once cancelled here (the `end`
frame: a cancelled call). A reader behind by `_HOLD_AT` events holds the
stream (flow control, as a Generate call's 64 KiB window: the engine's
writes wait and it coalesces its outputs).

Ownership: the `EnginePool` owns one `GenerateMany` per engine address.
"""

from __future__ import annotations

from collections.abc import Callable

import grpc

from services.common.proto.kvmesh.v1 import engine_pb2
from services.gateway.many_call import OK, FrameKind, ManyCall, rpc_error

__all__ = ["GenerateMany"]

# Unread events of one stream that hold it (a 64 KiB window held hundreds of
# small deltas; the engine coalesces everything after these into one).
_HOLD_AT = 64


_CODES = {code.value[0]: code for code in grpc.StatusCode}


def _ending(frame: engine_pb2.GenerateServerFrame) -> str | grpc.aio.AioRpcError | None:
    if not frame.end:
        return None
    if frame.HasField("status"):
        return rpc_error(_CODES.get(frame.status.code, grpc.StatusCode.UNKNOWN), frame.status.details)
    return OK



_GENERATE = FrameKind("GenerateMany", engine_pb2.GenerateClientFrame, engine_pb2.GenerateClientFrames, _ending,
                      hold_at=_HOLD_AT)


class GenerateMany(ManyCall):
    """The gateway's GenerateMany call to one engine."""

    def __init__(self, open_call: Callable[[], grpc.aio.StreamStreamCall]) -> None:
        super().__init__(_GENERATE, open_call)
