"""Per-key generation time limit (`api_keys[].max_generation_seconds`): the
key's cap ends a stream with a timeout even when the gateway-wide limit and
the request allow more; the engine is told to stop."""

from __future__ import annotations

import asyncio

import openai
import pytest
from conftest import KEY_SHORT, MODEL, Mesh
from openai.types.chat import ChatCompletionMessageParam

CHAT: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hello"}]


async def test_per_key_generation_limit_times_out_the_stream(mesh: Mesh) -> None:
    assert mesh.config.gateway.max_generation_seconds >= 60  # the key's 0.3 s is what applies
    engine = mesh.engines["engine-a"]
    engine.answer_tokens, engine.token_delay = 10_000, 0.02
    async with openai.AsyncOpenAI(base_url=f"{mesh.http}/v1", api_key=KEY_SHORT, max_retries=0, timeout=20) as c:
        stream = await c.chat.completions.create(model=MODEL, messages=CHAT, stream=True, max_tokens=1000)
        got = []
        with pytest.raises(openai.APIError, match="limit"):
            async for chunk in stream:
                got.append(chunk)
    assert len(got) >= 1  # the stream had started before the key's limit cut it
    await asyncio.wait_for(engine.cancelled.wait(), 10)
    assert (await mesh.scheduler.admits[0].wait_done()).finish_reason == "timeout"
