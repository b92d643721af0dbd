"""n > 1, echo, logit_bias, /tokenize + /detokenize and the served-models
listing at the gateway, against the fake scheduler and engine (conftest)."""

from __future__ import annotations

import asyncio

import aiohttp
import grpc
import openai
import pytest
from conftest import KEY_FULL, KEY_OTHER, MODEL, FakeEngine, Mesh, expected_answer
from openai.types.chat import ChatCompletionMessageParam

from services.common.proto.kvmesh.v1 import inference_pb2, inference_pb2_grpc

CHAT: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hello world"}]


def client(mesh: Mesh) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{mesh.http}/v1", api_key=KEY_FULL, max_retries=0, timeout=20)


async def test_n3_chat_runs_three_copies_on_the_first_engine(mesh: Mesh) -> None:
    async with client(mesh) as c:
        out = await c.chat.completions.create(model=MODEL, messages=CHAT, n=3, max_tokens=20, seed=7,
                                              temperature=0.5, extra_headers={"x-request-id": "r-n3"})
    sent = mesh.engines["engine-a"].requests
    assert sorted(r.request_id for r in sent) == ["r-n3", "r-n3-n1", "r-n3-n2"]
    assert sorted(r.sampling.seed for r in sent) == [7, 8, 9]   # seed + i, as vLLM
    admits = {a.request.request_id: a.request for a in mesh.scheduler.admits}
    assert admits["r-n3"].together_with == ""
    assert admits["r-n3-n1"].together_with == admits["r-n3-n2"].together_with == "r-n3"
    _, text = expected_answer(list(sent[0].prompt_token_ids), 6)
    assert [ch.index for ch in out.choices] == [0, 1, 2]
    assert all(ch.message.content == text and ch.finish_reason == "stop" for ch in out.choices)
    assert out.usage.prompt_tokens == len(sent[0].prompt_token_ids)  # counted once
    assert out.usage.completion_tokens == 18


async def test_n2_stream_chunks_carry_the_choice_index(mesh: Mesh) -> None:
    async with client(mesh) as c:
        stream = await c.chat.completions.create(model=MODEL, messages=CHAT, n=2, stream=True,
                                                 stream_options={"include_usage": True})
        chunks = [chunk async for chunk in stream]
    prompt = list(mesh.engines["engine-a"].requests[0].prompt_token_ids)
    _, text = expected_answer(prompt, 6)
    roles = [ch.choices[0].index for ch in chunks if ch.choices and ch.choices[0].delta.role]
    assert roles == [0, 1]
    for i in (0, 1):
        got = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices and ch.choices[0].index == i)
        assert got == text
    finals = sorted(ch.choices[0].index for ch in chunks if ch.choices and ch.choices[0].finish_reason)
    assert finals == [0, 1]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == len(prompt)


async def test_completions_echo_and_n(mesh: Mesh) -> None:
    async with client(mesh) as c:
        out = await c.completions.create(model=MODEL, prompt="hello world", echo=True, n=2, max_tokens=20)
        stream = await c.completions.create(model=MODEL, prompt="hello world", echo=True, stream=True)
        streamed = "".join([ch.choices[0].text async for ch in stream if ch.choices])
    prompt = list(mesh.engines["engine-a"].requests[0].prompt_token_ids)
    _, text = expected_answer(prompt, 6)
    assert [ch.text for ch in out.choices] == ["hello world" + text] * 2
    assert streamed == "hello world" + text


async def test_logit_bias_is_sent_to_the_engine_and_bounded(mesh: Mesh) -> None:
    async with client(mesh) as c:
        await c.chat.completions.create(model=MODEL, messages=CHAT, logit_bias={"3": -100, "5": 100})
        assert dict(mesh.engines["engine-a"].requests[0].sampling.logit_bias) == {3: -100.0, 5: 100.0}
        for bad in ({"3": 101}, {"x": 1}, {str(i): 1 for i in range(301)}, {"99999999": 1}):
            with pytest.raises(openai.BadRequestError) as err:
                await c.chat.completions.create(model=MODEL, messages=CHAT, logit_bias=bad)
            assert err.value.body["param"] == "logit_bias"
        with pytest.raises(openai.BadRequestError) as err:
            await c.completions.create(model=MODEL, prompt="x", echo=True, logprobs=1)
        assert err.value.body["param"] == "echo"
        with pytest.raises(openai.BadRequestError) as err:
            await c.chat.completions.create(model=MODEL, messages=CHAT, n=0)
        assert err.value.body["param"] == "n"
    assert len(mesh.engines["engine-a"].requests) == 1  # refused before queueing


async def test_n_stream_cannot_be_resumed(mesh: Mesh) -> None:
    body = {"model": MODEL, "messages": CHAT, "stream": True, "n": 2}
    async with aiohttp.ClientSession() as s, s.post(
        f"{mesh.http}/v1/chat/completions", json=body,
        headers={"Authorization": f"Bearer {KEY_FULL}", "Last-Event-ID": "abc.3"},
    ) as r:
        assert r.status == 400 and (await r.json())["error"]["param"] == "Last-Event-ID"


async def test_tokenize_detokenize_round_trip(mesh: Mesh) -> None:
    headers = {"Authorization": f"Bearer {KEY_FULL}"}
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{mesh.http}/tokenize", json={"model": MODEL, "prompt": "hello world",
                                                         "return_token_strs": True}, headers=headers) as r:
            tok = await r.json()
            assert r.status == 200, tok
        assert tok["count"] == len(tok["tokens"]) > 0 and tok["max_model_len"] > 0
        assert len(tok["token_strs"]) == tok["count"]
        async with s.post(f"{mesh.http}/detokenize", json={"model": MODEL, "tokens": tok["tokens"]},
                          headers=headers) as r:
            assert "hello" in (await r.json())["prompt"]
        async with s.post(f"{mesh.http}/tokenize", json={"model": MODEL, "messages": CHAT}, headers=headers) as r:
            chat = await r.json()
        sent_before = len(mesh.engines["engine-a"].requests)
        async with client(mesh) as c:
            await c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2)
        assert list(mesh.engines["engine-a"].requests[sent_before].prompt_token_ids) == chat["tokens"]
        for body, param in (({"model": MODEL}, "prompt"), ({"model": MODEL, "tokens": [-1]}, "tokens"),
                            ({"prompt": "x", "model": "nope"}, "model")):
            path = "/detokenize" if "tokens" in body else "/tokenize"
            async with s.post(f"{mesh.http}{path}", json=body, headers=headers) as r:
                assert r.status in (400, 404) and (await r.json())["error"]["param"] == param
        async with s.post(f"{mesh.http}/tokenize", json={"model": MODEL, "prompt": "x"},
                          headers={"Authorization": f"Bearer {KEY_OTHER}"}) as r:
            assert r.status in (403, 404)


async def test_grpc_n_and_tokenize(mesh: Mesh) -> None:
    channel = grpc.aio.insecure_channel(mesh.grpc_address)
    stub = inference_pb2_grpc.InferenceStub(channel)
    auth = (("authorization", f"Bearer {KEY_FULL}"),)
    async with channel:
        request = inference_pb2.ChatRequest(model=MODEL, messages=[inference_pb2.ChatMessage(role="user",
                                                                                             content="hi")], n=3)
        events = [e async for e in stub.Chat(request, metadata=auth)]
        tok = await stub.Tokenize(inference_pb2.TokenizeRequest(model=MODEL, prompt="hello world"), metadata=auth)
        detok = await stub.Detokenize(inference_pb2.DetokenizeRequest(model=MODEL, tokens=tok.tokens), metadata=auth)
    finished = [e.finished for e in events if e.HasField("finished")]
    assert sorted(f.choice_index for f in finished) == [0, 1, 2]
    assert {e.delta.choice_index for e in events if e.HasField("delta")} == {0, 1, 2}
    assert finished[-1].usage.completion_tokens == 18
    assert tok.count == len(tok.tokens) > 0 and "hello" in detok.prompt


async def test_models_list_only_served_models(mesh: Mesh) -> None:
    async with client(mesh) as c:
        models = await c.models.list()
        assert [(m.id, m.model_extra["engines"]) for m in models.data] == [(MODEL, 1)]
        assert models.data[0].model_extra["max_model_len"] > 0
        mesh.scheduler.engines.clear()          # the last engine for MODEL is gone
        await asyncio.sleep(1.7)                # past the listing's cache
        assert (await c.models.list()).data == []
        with pytest.raises(openai.NotFoundError):
            await c.models.retrieve(MODEL)


async def test_n2_each_choice_migrates_from_its_own_tokens(mesh: Mesh) -> None:
    """Engine-a fails every call after 3 tokens: each choice moves to engine-b
    on its own, continuing from prompt + its own 3 tokens, and both end whole."""
    a = mesh.engines["engine-a"]
    a.break_after, a.answer_tokens = 3, 9
    b = await mesh.add_engine(FakeEngine("engine-b", answer_tokens=9))
    async with client(mesh) as c:
        stream = await c.chat.completions.create(model=MODEL, messages=CHAT, n=2, stream=True,
                                                 stream_options={"include_usage": True})
        chunks = [ch async for ch in stream]
    prompt = list(a.requests[0].prompt_token_ids)
    ids, text = expected_answer(prompt, 9)
    for i in (0, 1):
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks
                       if ch.choices and ch.choices[0].index == i) == text
    assert len(b.requests) == 2 and sum(r.request_id.endswith("-n1") for r in b.requests) == 1
    assert all(list(r.prompt_token_ids) == prompt + ids[:3] and r.resumed_tokens == 3 for r in b.requests)
    assert chunks[-1].usage.completion_tokens == 18 and chunks[-1].usage.prompt_tokens == len(prompt)


async def test_n2_a_preempted_choice_requeues_alone(mesh: Mesh) -> None:
    """Choice 0 is preempted after 4 tokens: it requeues and continues on
    engine-b from its own tokens; choice 1 runs on undisturbed."""
    a = mesh.engines["engine-a"]
    a.answer_tokens, a.pause_after = 12, 4
    b = await mesh.add_engine(FakeEngine("engine-b", answer_tokens=12))
    mesh.scheduler.requeue_engines = ["engine-b"]

    async def run() -> list:
        async with client(mesh) as c:
            stream = await c.chat.completions.create(model=MODEL, messages=CHAT, n=2, stream=True,
                                                     extra_headers={"x-request-id": "r-p"})
            return [ch async for ch in stream]

    task = asyncio.create_task(run())
    await asyncio.wait_for(a.paused.wait(), 10)
    await asyncio.sleep(0.2)
    (record,) = [r for r in mesh.scheduler.admits if r.request.request_id == "r-p"]
    await mesh.scheduler.preempt(record)
    chunks = await asyncio.wait_for(task, 20)
    prompt = list(a.requests[0].prompt_token_ids)
    _, text = expected_answer(prompt, 12)
    for i in (0, 1):
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks
                       if ch.choices and ch.choices[0].index == i) == text
    (moved,) = b.requests
    assert moved.request_id == "r-p" and moved.resumed_tokens == 4
    assert [r.request_id for r in a.requests] == ["r-p", "r-p-n1"]
