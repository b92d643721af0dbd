"""The gateway's side of `Scheduler.AdmitMany`: its requests' Admit streams
over one long-lived call per scheduler replica (many_call.py has how).

`ManyStream` stands in for an Admit call in `AdmitSession` and `CallEnder`:
read returns EOF once the scheduler ended the stream (at `done`), raises the
call's AioRpcError when the call failed and CancelledError once cancelled
here; so the lease logic above it (lease_link.py) is the same on both. A
cancelled stream is the gateway's `end` frame: a cancelled Admit call.

Ownership: the `SchedulerClient` owns its `AdmitMany`.
"""

from __future__ import annotations

from collections.abc import Callable

import grpc

from services.common.proto.kvmesh.v1 import scheduler_pb2
from services.gateway.many_call import OK, FrameKind, ManyCall, ManyStream

__all__ = ["AdmitMany", "ManyStream"]


def _ending(frame: scheduler_pb2.AdmitServerFrame) -> str | None:
    return OK if frame.end else None


_ADMIT = FrameKind("AdmitMany", scheduler_pb2.AdmitClientFrame, scheduler_pb2.AdmitClientFrames, _ending)


class AdmitMany(ManyCall):
    """The gateway's AdmitMany call to one scheduler."""

    def __init__(self, open_call: Callable[[], grpc.aio.StreamStreamCall], answer_seconds: float = 0.0,
                 on_silent: Callable[[], None] | None = None) -> None:
        """The scheduler answers every request at once (Queued, Placed or
        Rejected): `answer_seconds` of silence fails the call (many_call.py)."""
        super().__init__(_ADMIT, open_call, answer_seconds, on_silent)
