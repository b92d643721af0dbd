"""The scheduler's per-class preemption figures (`SchedulerState.classes`
from GetState: preemptions, requeued, preempted now, seconds lost, displaced,
protected), read before and after a run so `kvmesh bench --scheduler` and the
priority scripts can report what the run itself caused.

An empty result means the scheduler fills no `classes` (a scheduler from
before preemption) or could not be reached: callers print "-" then.
"""

from __future__ import annotations

from typing import Any

__all__ = ["CUMULATIVE", "class_deltas", "class_figures", "read_classes", "scheduler_state"]

# Counters that only grow; `preempted_now` is a level and is reported as is.
CUMULATIVE = ("preemptions", "requeued", "seconds_lost", "displaced", "protected")


def class_figures(state: Any) -> dict[int, dict[str, float]]:
    """`state.classes` by priority (state may be None)."""
    out: dict[int, dict[str, float]] = {}
    for c in getattr(state, "classes", ()):
        out[int(c.priority)] = {
            "preemptions": float(c.preemptions), "requeued": float(c.requeued),
            "preempted_now": float(c.preempted_now), "seconds_lost": float(c.seconds_lost),
            "displaced": float(c.displaced), "protected": float(c.protected),
        }
    return out


def scheduler_state(address: str, timeout: float = 5.0) -> Any:
    """GetState from the scheduler at `address` (plaintext gRPC), None while
    it is unreachable."""
    import grpc  # only when asked: kvmesh bench runs against any endpoint

    from services.common.proto.kvmesh.v1 import scheduler_pb2, scheduler_pb2_grpc

    try:
        with grpc.insecure_channel(address) as channel:
            return scheduler_pb2_grpc.SchedulerStub(channel).GetState(scheduler_pb2.GetStateRequest(),
                                                                       timeout=timeout)
    except grpc.RpcError:
        return None


def read_classes(address: str, timeout: float = 5.0) -> dict[int, dict[str, float]]:
    """The per-class figures of the scheduler at `address`; {} when it is
    unreachable or fills no classes."""
    return class_figures(scheduler_state(address, timeout))


def class_deltas(before: dict[int, dict[str, float]],
                 after: dict[int, dict[str, float]]) -> dict[str, dict[str, float]]:
    """What happened between two readings, keyed "P0".."P2" like the bench
    summary's classes: counters as differences, `preempted_now` as read last."""
    out: dict[str, dict[str, float]] = {}
    for p, figures in sorted(after.items()):
        base = before.get(p, {})
        out[f"P{p}"] = {k: (v - base.get(k, 0.0)) if k in CUMULATIVE else v for k, v in figures.items()}
    return out
