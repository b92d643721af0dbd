"""What a request tells its scheduler last -- `done` when it finished, the
withdrawal when its client left -- reaches a scheduler that is slow to read.

A gRPC call cancelled while its last message is still unread at the peer
loses that message (the peer's read raises instead). A finished request's
tidy-up (acknowledge the engine, let the scheduler end the Admit stream) runs
after the client has its last event, so the transport closing must not
cancel it; a withdrawal waits (bounded) for the scheduler to end the stream.
Before, on a busy machine the scheduler saw a bare cancel: the deadline and
scaling samples of `done` were lost, and a withdrawn lease was kept for a
resume that never came (tests/unit/gateway/test_gateway_http.py flaked on it).
"""

from __future__ import annotations

import asyncio
from typing import Any

import openai
from conftest import KEY_FULL, MODEL, Mesh, leave_mid_stream
from openai.types.chat import ChatCompletionMessageParam

CHAT: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hello world"}]

# Long against the gateway's own tidy-up (a few ms), short against its bounds.
_SLOW_READ = 0.3


def client(mesh: Mesh, **kw: Any) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{mesh.http}/v1", api_key=KEY_FULL, max_retries=0, timeout=20, **kw)


async def test_done_reaches_a_slow_scheduler_after_a_whole_answer(mesh: Mesh) -> None:
    mesh.scheduler.read_delay = _SLOW_READ
    async with client(mesh) as c:
        out = await c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=50)
    assert out.choices[0].finish_reason == "stop"
    record = mesh.scheduler.admits[0]
    done = await record.wait_done()
    assert done.finish_reason == "stop" and done.completion_tokens == 6
    assert not record.cancelled


async def test_done_reaches_a_slow_scheduler_after_a_stream(mesh: Mesh) -> None:
    mesh.scheduler.read_delay = _SLOW_READ
    async with client(mesh) as c:
        stream = await c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=50, stream=True)
        reasons = [chunk.choices[0].finish_reason async for chunk in stream if chunk.choices]
    assert reasons[-1] == "stop"
    record = mesh.scheduler.admits[0]
    done = await record.wait_done()
    assert done.finish_reason == "stop"
    assert not record.cancelled


async def test_a_withdrawal_reaches_a_slow_scheduler(mesh: Mesh) -> None:
    engine = mesh.engines["engine-a"]
    engine.answer_tokens, engine.token_delay = 10_000, 0.02
    mesh.scheduler.read_delay = _SLOW_READ
    await leave_mid_stream(mesh)
    record = mesh.scheduler.admits[0]
    done = await record.wait_done()
    # Said, not just a cancelled call: the scheduler ends the lease now
    # instead of keeping it for a resume.
    assert done.finish_reason == "abort"
    await asyncio.wait_for(engine.cancelled.wait(), 10)
