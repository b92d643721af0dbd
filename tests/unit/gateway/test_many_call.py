"""`ManyStream` flow control (services/gateway/many_call.py): a reader
behind by `hold_at` messages holds its stream -- the engine's writes on it
wait and it coalesces meanwhile, as a full Generate call's window made it --
and reading it down releases it; a stream's end carries the status its call
would have ended with."""

from __future__ import annotations

from typing import Any

import grpc

from services.common.proto.kvmesh.v1 import engine_pb2
from services.gateway.generate_many import GenerateMany


def _never() -> Any:
    raise AssertionError("these tests open no call")


def _delta(i: int) -> engine_pb2.EngineGenerateEvent:
    return engine_pb2.EngineGenerateEvent(delta=engine_pb2.EngineDelta(token_ids=[i]))


async def test_a_reader_behind_holds_its_stream_until_it_reads_down() -> None:
    many = GenerateMany(_never)   # no call: its frames stay queued
    many.ready = True
    stream = many.stream()
    assert stream is not None
    hold_at = many.kind.hold_at
    for i in range(hold_at - 1):
        stream.push(_delta(i))
    assert not many._frames
    stream.push(_delta(hold_at))
    assert [(f.stream, f.hold) for f in many._frames] == [(stream.number, True)]
    many._frames.clear()
    read: list[Any] = []
    while len(read) < hold_at - hold_at // 4:
        read.append(await stream.read())
        assert not many._frames
    read.append(await stream.read())
    assert [(f.stream, f.release) for f in many._frames] == [(stream.number, True)]
    assert [m.delta.token_ids[0] for m in read] == list(range(len(read)))


async def test_an_end_with_a_status_fails_the_stream_with_it() -> None:
    many = GenerateMany(_never)
    many.ready = True
    stream = many.stream()
    assert stream is not None
    frame = engine_pb2.GenerateServerFrame(stream=stream.number, end=True, status=engine_pb2.StreamStatus(
        code=grpc.StatusCode.UNAVAILABLE.value[0], details="handed over"))
    how = many.kind.ending(frame)
    assert isinstance(how, grpc.aio.AioRpcError)
    stream.end(how)
    try:
        await stream.read()
        raise AssertionError("read past a failed end")
    except grpc.aio.AioRpcError as exc:
        assert exc.code() == grpc.StatusCode.UNAVAILABLE and exc.details() == "handed over"
    assert await stream.code() == grpc.StatusCode.UNAVAILABLE
    ok = many.stream()
    assert ok is not None
    ok.end(many.kind.ending(engine_pb2.GenerateServerFrame(stream=ok.number, end=True)) or "")
    assert await ok.read() is grpc.aio.EOF and await ok.code() == grpc.StatusCode.OK
