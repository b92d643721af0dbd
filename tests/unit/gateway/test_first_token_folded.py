"""The gateway tells the scheduler a request's first token with the engine's
next event (lease_link.py `first_token_next`): as its own `FirstToken` when
more follows, folded into `done` when the request ends right there -- one
Admit message instead of two for the shortest answers."""

from __future__ import annotations

from typing import Any

import openai
from conftest import KEY_FULL, MODEL, Mesh
from openai.types.chat import ChatCompletionMessageParam

CHAT: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hello world"}]


def client(mesh: Mesh, **kw: Any) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{mesh.http}/v1", api_key=KEY_FULL, max_retries=0, timeout=20, **kw)


async def test_a_one_token_answer_folds_first_token_into_done(mesh: Mesh) -> None:
    mesh.engines["engine-a"].answer_tokens = 1
    async with client(mesh) as c:
        out = await c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=50)
    assert out.usage is not None and out.usage.completion_tokens == 1
    record = mesh.scheduler.admits[0]
    done = await record.wait_done()
    assert record.messages == ["done"]
    assert done.HasField("first_token") and 0.0 <= done.first_token.seconds_ago < 5.0


async def test_a_longer_answer_tells_first_token_on_its_own(mesh: Mesh) -> None:
    async with client(mesh) as c:
        out = await c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=50)
    assert out.usage is not None and out.usage.completion_tokens == 6
    record = mesh.scheduler.admits[0]
    done = await record.wait_done()
    assert record.messages == ["first_token", "done"]
    assert not done.HasField("first_token")
