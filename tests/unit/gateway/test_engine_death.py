"""An engine whose backend dies mid-stream: the gateway's driver migrates
the stream (the engine ends it UNAVAILABLE, never `finish_reason: error`)
and the client sees one uninterrupted answer.

The dying engine is the real engine service over the sim backend (its
`crash` fault hook, as a SIGKILLed vLLM core raises EngineDeadError), placed
first; the fake "engine-a" takes the request over.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import openai
import pytest
from conftest import KEY_FULL, MODEL, Mesh
from openai.types.chat import ChatCompletionMessageParam

from services.common.config import EngineConfig
from services.engine.server import EngineService

CHAT: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hello world"}]
MAX_TOKENS = 60


@pytest.fixture
async def dying_engine(mesh: Mesh) -> AsyncIterator[EngineService]:
    engine = EngineConfig(engine_id="engine-sim", model=MODEL, port=0, scheduler_address="",
                          total_blocks=256, max_running=8, stop_grace_seconds=0.0)
    engine.sim.speed_factor = 2.0  # ~16 ms a token: the crash lands mid-stream
    svc = EngineService(mesh.config, engine)
    await svc.start()
    # Placement order: the sim engine first, the fake one for the migration.
    fake_address = mesh.scheduler.engines.pop("engine-a")
    mesh.scheduler.engines["engine-sim"] = f"127.0.0.1:{svc.port}"
    mesh.scheduler.engines["engine-a"] = fake_address
    mesh.engines["engine-a"].answer_tokens = 10_000  # no EOS: runs to max_tokens
    try:
        yield svc
    finally:
        await svc.stop()


async def test_a_dead_engines_stream_migrates_and_the_client_sees_no_error(
        mesh: Mesh, dying_engine: EngineService) -> None:
    async with openai.AsyncOpenAI(base_url=f"{mesh.http}/v1", api_key=KEY_FULL, max_retries=0, timeout=20) as c:
        stream = await c.chat.completions.create(model=MODEL, messages=CHAT, stream=True, max_tokens=MAX_TOKENS,
                                                 stream_options={"include_usage": True})
        chunks = []
        async for chunk in stream:
            chunks.append(chunk)
            if len(chunks) == 3:
                dying_engine.backend.crash("test: the engine core was SIGKILLed")  # type: ignore[attr-defined]  # the engine's sim backend: its crash() is a test hook
    reasons = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert reasons == ["length"] and chunks[-1].usage.completion_tokens == MAX_TOKENS
    record = mesh.scheduler.admits[0]
    assert [list(r.exclude_engines) for r in record.replaces] == [["engine-sim"]]
    resumed = mesh.engines["engine-a"].requests[0]
    assert 0 < resumed.resumed_tokens < MAX_TOKENS
    assert resumed.sampling.max_tokens == MAX_TOKENS - resumed.resumed_tokens
    assert dying_engine.runtime.dead is not None and not dying_engine.runtime.serving
