"""Stream resumption, the gateway's pure parts: Last-Event-ID parsing, the
one 404 for every refused resume, engine status codes of a resume, and
event indices surviving the event stream's coalescing."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from services.common.clock import SystemClock
from services.common.proto.kvmesh.v1 import scheduler_pb2
from services.gateway.errors import ErrorKind, GatewayError, classify_engine_rpc_error, from_rejection
from services.gateway.event_stream import EventStream
from services.gateway.events import Emit, TextDelta
from services.gateway.jobs import parse_last_event_id


@pytest.mark.parametrize(("header", "want"), [
    (None, None),
    ("abc.0", ("abc", 0)),
    ("req-42.17", ("req-42", 17)),
    ("a.b.c.5", ("a.b.c", 5)),          # request ids may contain dots: the last one splits
    (" 3f2a.41 ", ("3f2a", 41)),
])
def test_last_event_id_parses(header: str | None, want: tuple[str, int] | None) -> None:
    assert parse_last_event_id(header) == want


@pytest.mark.parametrize("header", ["", "abc", "abc.", ".5", "abc.-1", "abc.x", "a b.1", "abc.1234567890"])
def test_a_malformed_last_event_id_is_a_400(header: str) -> None:
    with pytest.raises(GatewayError) as err:
        parse_last_event_id(header)
    assert err.value.kind is ErrorKind.INVALID_REQUEST and err.value.code == "invalid_last_event_id"


def test_unknown_and_other_tenant_resumes_are_the_same_404() -> None:
    errors = [from_rejection(scheduler_pb2.Rejected(code=code, message=f"detail {code}"))
              for code in (scheduler_pb2.REJECT_CODE_RESUME_UNKNOWN, scheduler_pb2.REJECT_CODE_RESUME_FORBIDDEN)]
    assert {(e.kind, e.code, e.message) for e in errors} == {
        (ErrorKind.NOT_FOUND, "resume_not_found", errors[0].message)}
    assert "detail" not in errors[0].message  # the scheduler's reason (another tenant) stays inside


class _RpcError(grpc.aio.AioRpcError):
    def __init__(self, code: grpc.StatusCode) -> None:
        super().__init__(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details="x")


def test_engine_codes_of_a_resume() -> None:
    gone = classify_engine_rpc_error(_RpcError(grpc.StatusCode.NOT_FOUND), "e1")
    assert isinstance(gone, GatewayError) and gone.code == "resume_not_found"
    taken = classify_engine_rpc_error(_RpcError(grpc.StatusCode.ABORTED), "e1")
    assert isinstance(taken, GatewayError) and taken.code == "stream_resumed"


async def test_coalesced_deltas_keep_the_last_index() -> None:
    release = asyncio.Event()

    async def run(emit: Emit) -> None:
        for i in range(1, 5):
            await emit(TextDelta(f"t{i}", [i], index=i))
        await release.wait()

    stream = EventStream(run, heartbeat_seconds=60, clock=SystemClock())
    await asyncio.sleep(0.05)  # all four queued before the transport reads
    events = stream.__aiter__()
    merged = await anext(events)
    assert isinstance(merged, TextDelta) and merged.text == "t1t2t3t4" and merged.index == 4
    release.set()
    await stream.aclose()
