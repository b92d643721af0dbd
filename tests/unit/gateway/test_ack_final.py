"""`EngineRequest.ack_final` (Job.ack_final): the engine keeps a finished
generation for a resume until the gateway acknowledges its end -- asked only
where a client can resume the answer. A non-streamed HTTP response cannot be
resumed, so it asks for none: the engine ends the call with `finished` and
the gateway writes no acknowledgement."""

from __future__ import annotations

import aiohttp
import pytest
from conftest import KEY_FULL, MODEL, Mesh

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello world"}], "max_tokens": 50}


@pytest.mark.parametrize(("stream", "acked"), [(False, False), (True, True)])
async def test_only_a_resumable_answer_asks_the_engine_for_an_acknowledgement(
        mesh: Mesh, stream: bool, acked: bool) -> None:
    async with aiohttp.ClientSession() as s:
        r = await s.post(f"{mesh.http}/v1/chat/completions", json={**CHAT, "stream": stream},
                         headers={"Authorization": f"Bearer {KEY_FULL}"})
        assert r.status == 200
        await r.read()
    assert mesh.engines["engine-a"].requests[0].ack_final is acked
    assert (await mesh.scheduler.admits[0].wait_done()).finish_reason == "stop"
