"""Coalescing under load: a paced stream sends the first token at once,
merges what arrives while held, and never holds the final output."""

from __future__ import annotations

import asyncio

import grpc
from engine_helpers import engine_config, mesh_config, prompt_of

from services.common.proto.kvmesh.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from services.engine.backend import GenerationOutput
from services.engine.coalesce import DeltaBuffer, StreamPacing
from services.engine.server import EngineService


def test_pacing_applies_only_from_min_running() -> None:
    pacing = StreamPacing(interval_seconds=0.04, min_running=8)
    assert pacing.hold_seconds(7) == 0.0
    assert pacing.hold_seconds(8) == 0.04
    assert StreamPacing(0.0, 1).hold_seconds(100) == 0.0  # off


def test_unpaced_classes_keep_a_delta_per_step() -> None:
    pacing = StreamPacing(interval_seconds=0.04, min_running=1, unpaced_priorities=frozenset({0}))
    assert pacing.hold_seconds(50, priority=0) == 0.0
    assert pacing.hold_seconds(50, priority=1) == pacing.hold_seconds(50, priority=2) == 0.04


async def test_a_hold_merges_tokens_and_the_final_output_ends_it_early() -> None:
    buffer = DeltaBuffer()
    buffer.push(GenerationOutput(token_ids=[0], text="a"))
    assert (await buffer.take()).token_ids == [0]

    # A hold far longer than the test's timeout: only the final output can
    # end it in time.
    take = asyncio.create_task(buffer.take(hold_seconds=3600))
    for i in range(1, 5):
        buffer.push(GenerationOutput(token_ids=[i], text="b"))
        await asyncio.sleep(0)
    assert not take.done()  # tokens alone do not end a hold
    buffer.push(GenerationOutput(token_ids=[5], text="c", finish_reason="length", completion_tokens=6))
    out = await asyncio.wait_for(take, timeout=30)
    assert out.token_ids == [1, 2, 3, 4, 5] and out.text == "bbbbc" and out.finish_reason == "length"


async def test_a_hold_ends_with_its_interval() -> None:
    buffer = DeltaBuffer()
    take = asyncio.create_task(buffer.take(hold_seconds=0.05))
    buffer.push(GenerationOutput(token_ids=[7], text="x"))
    out = await asyncio.wait_for(take, timeout=30)
    assert out.token_ids == [7] and out.finish_reason is None


async def _deltas(stub: engine_pb2_grpc.EngineStub, rid: str, max_tokens: int,
                  priority: int = 1) -> tuple[list[list[int]], str]:
    call = stub.Generate()
    await call.write(engine_pb2.EngineGenerateMessage(request=engine_pb2.EngineRequest(
        request_id=rid, prompt_token_ids=prompt_of(16), priority=priority,
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens))))
    deltas: list[list[int]] = []
    text = ""
    while True:
        event = await call.read()
        if event.HasField("finished"):
            assert event.finished.usage.completion_tokens == max_tokens
            return deltas, text
        deltas.append(list(event.delta.token_ids))
        text += event.delta.text


def _flat(deltas: list[list[int]]) -> list[int]:
    return [token for delta in deltas for token in delta]


async def test_engine_paces_streams_under_load_without_changing_them() -> None:
    """Same request, same sim: unpaced it arrives a token per step; paced
    (interval long against a ~1 ms step) in a few deltas with the first token
    alone -- and the very same tokens and text."""
    results = {}
    for interval_ms in (0.0, 100.0):
        engine = engine_config(coalesce_interval_ms=interval_ms, coalesce_min_running=1)
        engine.sim.speed_factor = 0.1  # a few ms per step: tokens arrive over time
        svc = EngineService(mesh_config(), engine)
        await svc.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{svc.port}") as channel:
                stub = engine_pb2_grpc.EngineStub(channel)
                results[interval_ms] = await _deltas(stub, "r", 120)
                if interval_ms:
                    results["p0"] = await _deltas(stub, "p0", 120, priority=0)
        finally:
            await svc.stop()
    (plain, plain_text), (paced, paced_text) = results[0.0], results[100.0]
    assert _flat(plain) == _flat(paced) and plain_text == paced_text
    assert len(paced[0]) == 1  # the first token is never held
    assert len(paced) < len(plain) / 2, (len(paced), len(plain))
    # On the same paced engine a P0 stream is not held: deltas as unpaced.
    p0, p0_text = results["p0"]
    assert _flat(p0) == _flat(plain) and p0_text == plain_text
    assert len(p0) > 2 * len(paced), (len(p0), len(paced))
