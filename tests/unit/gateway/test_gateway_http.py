"""The OpenAI HTTP API, driven by the official `openai` client where it can be."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from conftest import (
    KEY_FULL,
    KEY_OTHER,
    KEY_P1,
    KEY_SLOW,
    MODEL,
    FakeEngine,
    Mesh,
    expected_answer,
    leave_mid_stream,
    token_text,
)
from openai.types.chat import ChatCompletionMessageParam

from services.common.proto.kvmesh.v1 import scheduler_pb2

CHAT: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hello world"}]


def client(mesh: Mesh, key: str = KEY_FULL, **kw: Any) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{mesh.http}/v1", api_key=key, max_retries=0, timeout=20, **kw)


async def test_chat_non_streaming(mesh: Mesh) -> None:
    mesh.engines["engine-a"].cached_tokens = 4
    async with client(mesh) as c:
        out = await c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=50)
    sent = mesh.engines["engine-a"].requests[0]
    _, text = expected_answer(list(sent.prompt_token_ids), 6)
    assert out.object == "chat.completion"
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == text
    assert out.choices[0].finish_reason == "stop"
    assert out.usage.prompt_tokens == len(sent.prompt_token_ids)
    assert out.usage.completion_tokens == 6
    assert out.usage.total_tokens == out.usage.prompt_tokens + 6
    assert out.usage.prompt_tokens_details.cached_tokens == 4
    # The scheduler heard the whole lifecycle.
    record = mesh.scheduler.admits[0]
    assert record.request.model == MODEL and record.request.tenant == "acme"
    assert record.request.max_tokens == 50
    done = await record.wait_done()
    assert record.messages == ["first_token", "done"]
    assert done.completion_tokens == 6 and done.finish_reason == "stop"


async def test_chat_streaming_with_usage(mesh: Mesh) -> None:
    async with client(mesh) as c:
        stream = await c.chat.completions.create(
            model=MODEL, messages=CHAT, stream=True, stream_options={"include_usage": True}, max_tokens=4,
        )
        chunks = [chunk async for chunk in stream]
    sent = mesh.engines["engine-a"].requests[0]
    _, text = expected_answer(list(sent.prompt_token_ids), 4)
    assert all(ch.object == "chat.completion.chunk" for ch in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert content == text
    finals = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finals == ["length"]  # max_tokens=4 < the fake's 6-token answer
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 0
    assert all(ch.usage is None for ch in chunks[:-1])


async def test_sse_wire_format_ends_with_done(mesh: Mesh) -> None:
    body = {"model": MODEL, "messages": CHAT, "stream": True}
    async with aiohttp.ClientSession() as s, s.post(
        f"{mesh.http}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY_FULL}",
                                                                 "x-request-id": "req-42"},
    ) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/event-stream")
        assert r.headers["x-request-id"] == "req-42"
        raw = (await r.read()).decode()
    frames = [e for e in raw.split("\n\n") if "data: " in e]
    # Resume points: the role chunk is event 0, each text chunk the count of
    # engine deltas so far; the final chunks carry no id (README "Resuming a stream").
    ids = [f.split("\n")[0] for f in frames if f.startswith("id: ")]
    assert ids[0] == "id: req-42.0" and len(ids) >= 2
    assert [int(i.rsplit(".", 1)[1]) for i in ids] == sorted({int(i.rsplit(".", 1)[1]) for i in ids})
    events = [f[f.index("data: "):] for f in frames]
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[0][6:])["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert mesh.scheduler.admits[0].request.request_id == "req-42"
    assert mesh.engines["engine-a"].requests[0].request_id == "req-42"


async def test_completions_stream_and_not(mesh: Mesh) -> None:
    async with client(mesh) as c:
        full = await c.completions.create(model=MODEL, prompt="hello world", max_tokens=3, logprobs=1)
        stream = await c.completions.create(model=MODEL, prompt=[11, 12, 13], max_tokens=10, stream=True)
        chunks = [ch async for ch in stream]
    first, second = mesh.engines["engine-a"].requests
    assert full.object == "text_completion"
    assert full.choices[0].text == expected_answer(list(first.prompt_token_ids), 3)[1]
    assert full.choices[0].finish_reason == "length"
    assert len(full.choices[0].logprobs.tokens) == 3  # type: ignore[arg-type]  # the SDK's Optional, set here
    assert full.choices[0].logprobs.token_logprobs == [-0.5] * 3
    assert list(second.prompt_token_ids) == [11, 12, 13]
    assert "".join(ch.choices[0].text for ch in chunks) == expected_answer([11, 12, 13], 6)[1]
    assert chunks[-1].choices[0].finish_reason == "stop"


async def test_chat_logprobs(mesh: Mesh) -> None:
    async with client(mesh) as c:
        out = await c.chat.completions.create(model=MODEL, messages=CHAT, logprobs=True, top_logprobs=2)
    content = out.choices[0].logprobs.content
    assert len(content) == 6 and content[0].logprob == -0.5 and len(content[0].top_logprobs) == 1  # type: ignore[arg-type]  # the SDK's Optional, set here
    assert mesh.engines["engine-a"].requests[0].sampling.logprobs == 2


async def test_sampling_params_reach_the_engine(mesh: Mesh) -> None:
    async with client(mesh) as c:
        await c.chat.completions.create(
            model=MODEL, messages=CHAT, max_completion_tokens=7, temperature=0.3, top_p=0.9, seed=5,
            presence_penalty=0.5, frequency_penalty=-0.5, stop=["w1"], extra_body={"top_k": 20},
        )
    s = mesh.engines["engine-a"].requests[0].sampling
    assert s.max_tokens == 7 and s.top_k == 20 and s.seed == 5 and list(s.stop) == ["w1"]
    assert s.temperature == pytest.approx(0.3) and s.top_p == pytest.approx(0.9)
    assert s.presence_penalty == pytest.approx(0.5) and s.frequency_penalty == pytest.approx(-0.5)


async def test_models_health_openapi(mesh: Mesh) -> None:
    async with client(mesh) as c:
        models = await c.models.list()
    assert [m.id for m in models.data] == [MODEL]
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{mesh.http}/health") as r:
            assert r.status == 200
        async with s.get(f"{mesh.http}/openapi.json") as r:
            doc = await r.json()
        async with s.get(f"{mesh.http}/v1/models", headers={"Authorization": f"Bearer {KEY_OTHER}"}) as r:
            assert (await r.json())["data"] == []
    assert doc["openapi"].startswith("3.")
    assert {"/v1/chat/completions", "/v1/completions", "/v1/models", "/health"} <= set(doc["paths"])


# ------------------------------------------------------------------ errors


async def test_sdk_error_types(mesh: Mesh) -> None:
    async with client(mesh, key="sk-wrong") as c:
        with pytest.raises(openai.AuthenticationError):
            await c.chat.completions.create(model=MODEL, messages=CHAT)
    async with client(mesh) as c:
        with pytest.raises(openai.NotFoundError) as nf:
            await c.chat.completions.create(model="no-such-model", messages=CHAT)
        assert nf.value.body["param"] == "model"
        with pytest.raises(openai.BadRequestError) as bad:
            await c.chat.completions.create(model=MODEL, messages=CHAT, temperature=5)
        assert bad.value.body["param"] == "temperature" and "between 0 and 2" in bad.value.message
        with pytest.raises(openai.BadRequestError, match="n must be an integer between 1 and 8"):
            await c.chat.completions.create(model=MODEL, messages=CHAT, n=9)
        with pytest.raises(openai.BadRequestError) as ctx:
            await c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=10_000_000)
        assert ctx.value.code == "context_length_exceeded" and "10000000" in ctx.value.message
    async with client(mesh, key=KEY_OTHER) as c:
        with pytest.raises(openai.PermissionDeniedError):
            await c.chat.completions.create(model=MODEL, messages=CHAT)
    assert mesh.scheduler.admits == []  # none of these reached the scheduler


async def test_raw_http_errors(mesh: Mesh) -> None:
    auth = {"Authorization": f"Bearer {KEY_FULL}"}
    url = f"{mesh.http}/v1/chat/completions"
    async with aiohttp.ClientSession() as s:
        async with s.post(url, data=b"{not json", headers=auth) as r:
            body = await r.json()
            assert r.status == 400 and body["error"]["code"] == "invalid_json"
            assert set(body["error"]) == {"message", "type", "param", "code"}
        async with s.post(url, json={"model": MODEL}, headers=auth) as r:
            assert r.status == 400 and (await r.json())["error"]["param"] == "messages"
        async with s.post(url, json={"model": MODEL, "messages": CHAT, "x": "a" * 70_000}, headers=auth) as r:
            assert r.status == 413 and (await r.json())["error"]["type"] == "invalid_request_error"
        async with s.post(url, json={"model": MODEL, "messages": CHAT}) as r:
            assert r.status == 401
        async with s.post(url, json={"model": MODEL, "messages": CHAT}, headers={**auth, "X-Priority": "7"}) as r:
            assert r.status == 400 and (await r.json())["error"]["param"] == "X-Priority"
        async with s.get(f"{mesh.http}/v1/nope") as r:
            assert r.status == 404 and "error" in await r.json()


async def test_key_rate_limit_429(mesh: Mesh) -> None:
    async with client(mesh, key=KEY_SLOW) as c:
        await c.chat.completions.create(model=MODEL, messages=CHAT)
        with pytest.raises(openai.RateLimitError) as err:
            await c.chat.completions.create(model=MODEL, messages=CHAT)
    headers = err.value.response.headers
    assert int(headers["retry-after"]) >= 1
    assert headers["x-ratelimit-limit-requests"] == "1"
    assert headers["x-ratelimit-remaining-requests"] == "0"


@pytest.mark.parametrize(
    ("code", "exc", "status"),
    [
        (scheduler_pb2.REJECT_CODE_QUEUE_FULL, openai.RateLimitError, 429),
        (scheduler_pb2.REJECT_CODE_TENANT_FULL, openai.RateLimitError, 429),
        (scheduler_pb2.REJECT_CODE_EXPIRED, openai.InternalServerError, 503),
        (scheduler_pb2.REJECT_CODE_NO_ENGINE, openai.InternalServerError, 503),
        (scheduler_pb2.REJECT_CODE_DRAINING, openai.InternalServerError, 503),
        (scheduler_pb2.REJECT_CODE_TOO_LARGE, openai.BadRequestError, 400),
        (scheduler_pb2.REJECT_CODE_INVALID, openai.BadRequestError, 400),
    ],
)
async def test_scheduler_rejections(model_dir: Path, code: scheduler_pb2.RejectCode,
                                    exc: type[openai.APIStatusError], status: int) -> None:
    """A rejection before the stream's first byte is the response's status. A
    mesh of its own with a long heartbeat: the shared one's 0.2 s heartbeat
    starts the SSE response first when a loaded machine is slower than that
    (the rejection then arrives as an in-stream error, as it should then)."""
    from conftest import open_mesh

    async with open_mesh(model_dir, heartbeat_seconds=30.0) as mesh:
        mesh.scheduler.reject = scheduler_pb2.Rejected(code=code, message="fake", retry_after_seconds=2.5)
        async with client(mesh) as c:
            for stream in (False, True):
                with pytest.raises(exc) as err:
                    out = await c.chat.completions.create(model=MODEL, messages=CHAT, stream=stream)
                    async for _ in out:  # pragma: no cover - the status comes first
                        pass
                assert err.value.status_code == status
                if status != 400:
                    assert err.value.response.headers["retry-after"] == "3"


async def test_scheduler_unreachable_503(model_dir: Path) -> None:
    from conftest import make_config

    from services.gateway.server import GatewayService

    gateway = GatewayService(make_config(model_dir, "127.0.0.1:1"))  # nothing listens on port 1
    http_port, _ = await gateway.start(http_port=0, grpc_port=0)
    try:
        async with openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key=KEY_FULL,
                                      max_retries=0) as c:
            with pytest.raises(openai.InternalServerError) as err:
                await c.chat.completions.create(model=MODEL, messages=CHAT)
        assert err.value.status_code == 503 and "scheduler" in err.value.message
        async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{http_port}/health") as r:
            assert r.status == 503
    finally:
        await gateway.stop(grace=0.1)


# ------------------------------------------------------------------ scheduling behaviour


async def test_priority_ceiling_applied(mesh: Mesh) -> None:
    async with client(mesh, key=KEY_P1) as c:
        await c.chat.completions.create(model=MODEL, messages=CHAT, extra_headers={"X-Priority": "0"})
        await c.chat.completions.create(model=MODEL, messages=CHAT, extra_headers={"X-Priority": "2"})
    async with client(mesh) as c:
        await c.chat.completions.create(model=MODEL, messages=CHAT, extra_headers={"X-Priority": "0"})
        await c.chat.completions.create(model=MODEL, messages=CHAT)
    assert [a.request.priority for a in mesh.scheduler.admits] == [1, 2, 0, 1]
    assert [a.request.tenant for a in mesh.scheduler.admits] == ["bulk", "bulk", "acme", "acme"]
    assert mesh.engines["engine-a"].requests[0].priority == 1


async def test_heartbeats_while_queued(mesh: Mesh) -> None:
    mesh.scheduler.queue_hold = asyncio.Event()
    body = {"model": MODEL, "messages": CHAT, "stream": True}
    async with aiohttp.ClientSession() as s, s.post(
        f"{mesh.http}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY_FULL}"},
    ) as r:
        assert r.status == 200
        lines: list[str] = []
        while len([ln for ln in lines if ln.startswith(":")]) < 2:
            lines.append((await r.content.readline()).decode().strip())
        assert not any(ln.startswith("data:") and "content\":\" w" in ln for ln in lines)
        mesh.scheduler.queue_hold.set()
        rest = (await r.read()).decode()
    assert rest.rstrip().endswith("data: [DONE]")


async def test_client_disconnect_cancels_engine(mesh: Mesh) -> None:
    engine = mesh.engines["engine-a"]
    engine.answer_tokens, engine.token_delay = 10_000, 0.02
    left_at = await leave_mid_stream(mesh)
    await asyncio.wait_for(engine.cancelled.wait(), 10)
    await asyncio.wait_for(mesh.scheduler.admit_cancelled.wait(), 10)
    delay = engine.cancelled_at - left_at
    print(f"engine saw the cancel {delay * 1000:.1f} ms after the client left")
    assert len(engine.requests) == 1
    # Said, not just a closed call: the engine ends it rather than keeping it for a resume.
    assert engine.polite_cancels == 1


async def test_migration_is_seamless(mesh: Mesh) -> None:
    a = mesh.engines["engine-a"]
    a.break_after, a.answer_tokens = 3, 9
    b = await mesh.add_engine(FakeEngine("engine-b", answer_tokens=9))
    async with client(mesh) as c:
        stream = await c.chat.completions.create(model=MODEL, messages=CHAT, stream=True,
                                                 stream_options={"include_usage": True})
        chunks = [ch async for ch in stream]
    prompt = list(a.requests[0].prompt_token_ids)
    ids, text = expected_answer(prompt, 9)
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == text
    assert chunks[-1].usage.completion_tokens == 9 and chunks[-1].usage.prompt_tokens == len(prompt)
    resumed = b.requests[0]
    assert list(resumed.prompt_token_ids) == prompt + ids[:3] and resumed.resumed_tokens == 3
    assert resumed.sampling.max_tokens == a.requests[0].sampling.max_tokens - 3
    record = mesh.scheduler.admits[0]
    assert [list(r.exclude_engines) for r in record.replaces] == [["engine-a"]]
    assert record.replaces[0].prompt_tokens == len(prompt) + 3
    assert (await record.wait_done()).completion_tokens == 9


async def _answer_pieces(mesh: Mesh, n: int) -> list[str]:
    """The fake model's answer to CHAT, token by token (a probe request)."""
    async with client(mesh) as c:
        await c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=n)
    engine = mesh.engines["engine-a"]
    prompt = list(engine.requests.pop().prompt_token_ids)
    return [token_text(t) for t in expected_answer(prompt, n)[0]]


async def _stream_text(mesh: Mesh, stop: str) -> tuple[str, str | None, int]:
    async with client(mesh) as c:
        stream = await c.chat.completions.create(model=MODEL, messages=CHAT, stream=True, stop=[stop],
                                                 stream_options={"include_usage": True})
        chunks = [ch async for ch in stream]
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    reasons = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    return text, reasons[-1] if reasons else None, chunks[-1].usage.completion_tokens


async def test_stop_string_across_a_migration_seam_still_stops(mesh: Mesh) -> None:
    """Engine A holds back the tail of its text that may begin a stop string
    and dies; the stop string ends in engine B's first token. Neither engine
    sees it whole: the gateway carries A's held text across the seam and
    applies the stop strings there."""
    a = mesh.engines["engine-a"]
    a.answer_tokens = 9
    pieces = await _answer_pieces(mesh, 9)
    m = 4                                          # A dies after 4 tokens
    stop = pieces[m - 1][-2:] + pieces[m][:3]      # 2 chars of A's last token + 3 of B's first
    full = "".join(pieces)
    seam_at = len("".join(pieces[:m])) - 2
    assert full.find(stop) == seam_at, "the probe answer repeats the stop string earlier; pick another"
    a.break_after = m
    await mesh.add_engine(FakeEngine("engine-b", answer_tokens=9))
    text, reason, completion = await _stream_text(mesh, stop)
    assert text == full[:seam_at]
    assert reason == "stop"
    assert completion == m + 1                     # A's 4 tokens and the one from B that completed it


async def test_text_held_for_a_stop_string_survives_a_migration(mesh: Mesh) -> None:
    a = mesh.engines["engine-a"]
    a.answer_tokens = 9
    pieces = await _answer_pieces(mesh, 9)
    a.break_after = 4
    b = await mesh.add_engine(FakeEngine("engine-b", answer_tokens=9))
    text, reason, completion = await _stream_text(mesh, "\x00never\x00")  # held back, never matched
    assert text == "".join(pieces)                 # nothing A held back went missing
    assert reason == "stop" and completion == 9    # the fake model's EOS after 9 tokens
    assert b.requests[0].resumed_tokens == 4


async def test_failure_before_first_token_retries(mesh: Mesh) -> None:
    mesh.engines["engine-a"].break_after = 0
    await mesh.add_engine(FakeEngine("engine-b"))
    async with client(mesh) as c:
        out = await c.chat.completions.create(model=MODEL, messages=CHAT)
    assert out.usage.completion_tokens == 6
    assert len(mesh.engines["engine-b"].requests) == 1


async def test_all_engines_broken_is_503(mesh: Mesh) -> None:
    mesh.engines["engine-a"].break_after = 0
    async with client(mesh) as c:
        with pytest.raises(openai.InternalServerError) as err:
            await c.chat.completions.create(model=MODEL, messages=CHAT)
    assert err.value.status_code == 503


async def test_timeout_mid_stream_is_an_error_event(mesh: Mesh) -> None:
    mesh.config.gateway.max_generation_seconds = 0.3
    engine = mesh.engines["engine-a"]
    engine.answer_tokens, engine.token_delay = 10_000, 0.02
    async with client(mesh) as c:
        stream = await c.chat.completions.create(model=MODEL, messages=CHAT, stream=True, max_tokens=1000)
        got = []
        with pytest.raises(openai.APIError, match="limit"):
            async for ch in stream:
                got.append(ch)
    assert len(got) >= 1  # the stream had started before the timeout cut it
    await asyncio.wait_for(engine.cancelled.wait(), 10)
    assert (await mesh.scheduler.admits[0].wait_done()).finish_reason == "timeout"
