"""Tool calling through the gateway, HTTP (the official `openai` client) and
native gRPC, on a scripted engine that writes what a model would: the
tools reach the prompt, a forced choice reaches the engine as a JSON-schema
constraint, and the engine's text comes back as OpenAI tool calls."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import grpc
import openai
import pytest
from conftest import KEY_FULL, MODEL, Mesh, open_mesh
from openai.types.chat import ChatCompletionMessageParam, ChatCompletionToolParam

from services.common.proto.kvmesh.v1 import (
    common_pb2,
    engine_pb2,
    engine_pb2_grpc,
    inference_pb2,
    inference_pb2_grpc,
)
from services.common.tokenizer import HfTokenizer

WEATHER: ChatCompletionToolParam = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ASK: list[ChatCompletionMessageParam] = [{"role": "user", "content": "What is the weather in Paris?"}]
HERMES = ["Let me check.", "\n<tool_", 'call>\n{"name": "get_weather", ', '"arguments": {"city": ',
          '"Paris"}}\n</tool_call>']


class ScriptedEngine(engine_pb2_grpc.EngineServicer):
    """Answers every request with `script`: one token per piece of text."""

    def __init__(self, engine_id: str, script: list[str]) -> None:
        self.engine_id = engine_id
        self.script = script
        self.requests: list[engine_pb2.EngineRequest] = []
        self.address = ""
        self.server: grpc.aio.Server | None = None

    async def Generate(self, request_iterator: object, context: grpc.aio.ServicerContext) -> None:  # noqa: N802 - the proto's method name
        request = (await context.read()).request
        self.requests.append(request)
        for i, piece in enumerate(self.script):
            await context.write(engine_pb2.EngineGenerateEvent(delta=engine_pb2.EngineDelta(
                token_ids=[100 + i], text=piece)))
        await context.write(engine_pb2.EngineGenerateEvent(finished=engine_pb2.EngineFinished(
            finish_reason=common_pb2.FINISH_REASON_STOP,
            usage=common_pb2.Usage(prompt_tokens=len(request.prompt_token_ids),
                                   completion_tokens=len(self.script)))))
        while await context.read() is not grpc.aio.EOF:  # the gateway's ack / close
            pass


@pytest.fixture
async def tools_mesh(model_dir: Path) -> AsyncIterator[Mesh]:
    async with open_mesh(model_dir) as m:
        engine = ScriptedEngine("engine-s", HERMES)
        await m.add_engine(engine)  # type: ignore[arg-type]  # a scripted engine in place of a FakeEngine
        m.scheduler.engines.pop("engine-a")
        yield m


def scripted(mesh: Mesh) -> ScriptedEngine:
    engine = mesh.engines["engine-s"]
    assert isinstance(engine, ScriptedEngine)
    return engine


def client(mesh: Mesh) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{mesh.http}/v1", api_key=KEY_FULL, max_retries=0, timeout=20)


def prompt_text(mesh: Mesh, model_dir: Path) -> str:
    return HfTokenizer(model_dir).decode(list(scripted(mesh).requests[-1].prompt_token_ids))


async def test_auto_non_streamed_call(tools_mesh: Mesh, model_dir: Path) -> None:
    async with client(tools_mesh) as c:
        out = await c.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER])
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    (call,) = choice.message.tool_calls or []
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    # The model saw the tools (generic prompt: tiny-llama's template has no tool support).
    assert "get_weather" in prompt_text(tools_mesh, model_dir)
    assert not scripted(tools_mesh).requests[-1].sampling.HasField("structured")


async def test_auto_streamed_call_deltas(tools_mesh: Mesh) -> None:
    async with client(tools_mesh) as c:
        stream = await c.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], stream=True)
        chunks = [chunk async for chunk in stream]
    deltas = [ch.choices[0].delta for ch in chunks]
    assert deltas[0].role == "assistant"
    assert "".join(d.content or "" for d in deltas) == "Let me check."
    calls = [tc for d in deltas for tc in d.tool_calls or []]
    assert calls[0].id and calls[0].type == "function" and calls[0].function.name == "get_weather"
    assert calls[0].function.arguments == ""
    assert all(tc.id is None and tc.index == 0 for tc in calls[1:])
    assert json.loads("".join(tc.function.arguments for tc in calls[1:])) == {"city": "Paris"}  # type: ignore[misc]  # the SDK types a delta's function as Optional
    assert len(calls) >= 3, "arguments stream in fragments"
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


async def test_tool_stream_has_no_resume_ids(tools_mesh: Mesh) -> None:
    body = {"model": MODEL, "messages": ASK, "tools": [WEATHER], "stream": True}
    headers = {"Authorization": f"Bearer {KEY_FULL}"}
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{tools_mesh.http}/v1/chat/completions", json=body, headers=headers) as r:
            raw = (await r.read()).decode()
        assert "id: " not in raw and raw.endswith("data: [DONE]\n\n")
        headers["Last-Event-ID"] = "abc.3"
        async with s.post(f"{tools_mesh.http}/v1/chat/completions", json=body, headers=headers) as r:
            assert r.status == 400 and (await r.json())["error"]["param"] == "Last-Event-ID"


async def test_tools_with_several_choices_are_refused(tools_mesh: Mesh) -> None:
    """One tool-call parser reads one choice: n > 1 with tools is a 400 on n."""
    body = {"model": MODEL, "messages": ASK, "tools": [WEATHER], "n": 2}
    headers = {"Authorization": f"Bearer {KEY_FULL}"}
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{tools_mesh.http}/v1/chat/completions", json=body, headers=headers) as r:
            assert r.status == 400 and (await r.json())["error"]["param"] == "n"


async def test_required_is_constrained_and_parsed_as_json(tools_mesh: Mesh, model_dir: Path) -> None:
    scripted(tools_mesh).script = ['[{"name": "get_weather", ', '"arguments": {"city": "Paris"}}]']
    async with client(tools_mesh) as c:
        out = await c.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER],
                                              tool_choice="required")
    sampling = scripted(tools_mesh).requests[-1].sampling
    assert sampling.structured.kind == common_pb2.StructuredOutput.KIND_JSON_SCHEMA
    schema = json.loads(sampling.structured.value)
    assert schema["type"] == "array" and schema["items"]["properties"]["name"]["enum"] == ["get_weather"]
    assert out.choices[0].finish_reason == "tool_calls" and out.choices[0].message.content is None
    (call,) = out.choices[0].message.tool_calls or []
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    # The generic prompt asks for what the constraint allows: bare JSON.
    assert "<tool_call>" not in prompt_text(tools_mesh, model_dir)


async def test_named_choice_is_one_object(tools_mesh: Mesh) -> None:
    scripted(tools_mesh).script = ['{"name": "get_weather", "arguments": {"city": "Oslo"}}']
    async with client(tools_mesh) as c:
        stream = await c.chat.completions.create(
            model=MODEL, messages=ASK, tools=[WEATHER], stream=True,
            tool_choice={"type": "function", "function": {"name": "get_weather"}})
        chunks = [chunk async for chunk in stream]
    schema = json.loads(scripted(tools_mesh).requests[-1].sampling.structured.value)
    assert schema["type"] == "object"
    calls = [tc for ch in chunks for tc in ch.choices[0].delta.tool_calls or []]
    assert calls[0].function.name == "get_weather"
    assert json.loads("".join(tc.function.arguments or "" for tc in calls)) == {"city": "Oslo"}


async def test_none_offers_no_tools_and_parses_nothing(tools_mesh: Mesh, model_dir: Path) -> None:
    async with client(tools_mesh) as c:
        out = await c.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="none")
    assert out.choices[0].finish_reason == "stop" and not out.choices[0].message.tool_calls
    assert out.choices[0].message.content == "".join(HERMES)
    assert "get_weather" not in prompt_text(tools_mesh, model_dir)


async def test_history_round_trip_reaches_the_prompt(tools_mesh: Mesh, model_dir: Path) -> None:
    scripted(tools_mesh).script = ["It is ", "sunny in Paris."]
    call = {"id": "call_abc", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_abc", "content": "sunny, 21C"}]
    async with client(tools_mesh) as c:
        out = await c.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER])  # type: ignore[arg-type]  # plain dicts for the SDK's message and tool TypedDicts
    assert out.choices[0].message.content == "It is sunny in Paris." and out.choices[0].finish_reason == "stop"
    text = prompt_text(tools_mesh, model_dir)
    assert "sunny, 21C" in text and '"city": "Paris"' in text


async def test_malformed_tools_are_400_before_queueing(tools_mesh: Mesh) -> None:
    bad = {"type": "function", "function": {"name": "get weather"}}
    async with client(tools_mesh) as c:
        with pytest.raises(openai.BadRequestError) as err:
            await c.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, bad])  # type: ignore[list-item]  # plain dicts for the SDK's message and tool TypedDicts
    assert err.value.body["param"] == "tools[1].function.name"
    assert tools_mesh.scheduler.admits == []


# ------------------------------------------------------------ gRPC


def _grpc_request(**fields: object) -> inference_pb2.ChatRequest:
    tool = inference_pb2.Tool(name="get_weather", description="Current weather",
                              parameters_json=json.dumps(WEATHER["function"]["parameters"]))
    return inference_pb2.ChatRequest(model=MODEL, messages=[inference_pb2.ChatMessage(role="user", content="hi")],
                                     tools=[tool], **fields)  # type: ignore[arg-type]  # each case's proto fields, typed object


async def _chat(mesh: Mesh, request: inference_pb2.ChatRequest) -> list[inference_pb2.GenerateEvent]:
    async with grpc.aio.insecure_channel(mesh.grpc_address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        call = stub.Chat(request, metadata=(("authorization", f"Bearer {KEY_FULL}"),))
        return [e async for e in call]


async def test_grpc_tool_call_events(tools_mesh: Mesh) -> None:
    events = await _chat(tools_mesh, _grpc_request())
    text = "".join(e.delta.text for e in events if e.HasField("delta"))
    assert text == "Let me check."
    assert sum(len(e.delta.token_ids) for e in events if e.HasField("delta")) == len(HERMES)
    pieces = [e.tool_call for e in events if e.HasField("tool_call")]
    assert pieces[0].id.startswith("call_") and pieces[0].name == "get_weather" and pieces[0].index == 0
    assert json.loads("".join(p.arguments for p in pieces)) == {"city": "Paris"}
    assert events[-1].finished.finish_reason == common_pb2.FINISH_REASON_TOOL_CALLS


async def test_grpc_required_and_history(tools_mesh: Mesh) -> None:
    scripted(tools_mesh).script = ['{"name": "get_weather", "arguments": {"city": "Rome"}}']
    history = [
        inference_pb2.ChatMessage(role="user", content="weather?"),
        inference_pb2.ChatMessage(role="assistant", tool_calls=[inference_pb2.ToolCall(
            id="call_1", name="get_weather", arguments='{"city": "Paris"}')]),
        inference_pb2.ChatMessage(role="tool", tool_call_id="call_1", content="sunny"),
    ]
    request = _grpc_request(tool_choice=inference_pb2.ToolChoice(function="get_weather"), parallel_tool_calls=False)
    del request.messages[:]
    request.messages.extend(history)
    events = await _chat(tools_mesh, request)
    assert scripted(tools_mesh).requests[-1].sampling.HasField("structured")
    pieces = [e.tool_call for e in events if e.HasField("tool_call")]
    assert pieces[0].name == "get_weather"
    assert json.loads("".join(p.arguments for p in pieces)) == {"city": "Rome"}


@pytest.mark.parametrize(("change", "param"), [
    ({"tools": [inference_pb2.Tool(name="bad name")]}, "tools[0].name"),
    ({"tools": [inference_pb2.Tool(name="f", parameters_json="{nope")]}, "tools[0].parameters_json"),
    ({"tool_choice": inference_pb2.ToolChoice(mode="always")}, "tool_choice"),
    ({"tool_choice": inference_pb2.ToolChoice(function="other")}, "tool_choice.name"),
])
async def test_grpc_malformed_tools_are_invalid_argument(
    tools_mesh: Mesh, change: dict[str, object], param: str
) -> None:
    request = _grpc_request()
    for name, value in change.items():
        if name == "tools":
            del request.tools[:]
            request.tools.extend(value)  # type: ignore[arg-type]  # each case's proto tools, typed object
        else:
            getattr(request, name).CopyFrom(value)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await asyncio.wait_for(_chat(tools_mesh, request), 20)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert param in (err.value.details() or "")
    assert tools_mesh.scheduler.admits == []
