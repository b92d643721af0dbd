"""Tool calling through the real Envoy on the sim mesh (scheduler, two sim
engines, one gateway; tiny-llama, SmolLM2's template: the generic tool
prompt). The sim honours a forced tool choice's JSON schema (it emits the
schema's minimal instance: services/engine/sim/structured.py), so the
official SDK's round trip, native gRPC through grpcurl and the browser's
SSE bridge (POST /v1/chat) each get valid calls."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import openai
import pytest
import requests
from jsonschema import Draft202012Validator
from openai.types.chat import ChatCompletionMessageParam, ChatCompletionToolParam

from services.launcher.mesh import Mesh

pytestmark = pytest.mark.e2e

MODEL = "tiny-llama"
GRPCURL = str(Path(sys.prefix) / "bin" / "grpcurl")
PARAMETERS: dict[str, Any] = {"type": "object", "properties": {"city": {"type": "string", "minLength": 2}},
                              "required": ["city"]}
WEATHER: ChatCompletionToolParam = {
    "type": "function",
    "function": {"name": "get_weather", "description": "The current weather in a city", "parameters": PARAMETERS}}
ASK: ChatCompletionMessageParam = {"role": "user", "content": "What is the weather in Paris?"}


@pytest.fixture(scope="module")
def sdk(e2e_mesh: Mesh) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{e2e_mesh.endpoints.public_http}/v1", api_key=e2e_mesh.api_key,
                         timeout=60.0, max_retries=0)


def _check_call(name: str, arguments: str) -> None:
    assert name == "get_weather"
    Draft202012Validator(PARAMETERS).validate(json.loads(arguments))


def test_sdk_round_trip_not_streamed(sdk: openai.OpenAI) -> None:
    out = sdk.chat.completions.create(model=MODEL, messages=[ASK], tools=[WEATHER], tool_choice="required",
                                      max_tokens=64)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = choice.message.tool_calls or []
    assert calls and all(c.id.startswith("call_") for c in calls)
    for call in calls:
        _check_call(call.function.name, call.function.arguments)
    history: list[Any] = [ASK, choice.message.model_dump(exclude_none=True),
                          *({"role": "tool", "tool_call_id": c.id, "content": "sunny"} for c in calls)]
    answer = sdk.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER], tool_choice="none",
                                         max_tokens=8)
    assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls


def test_sdk_streamed_named_call(sdk: openai.OpenAI) -> None:
    stream = sdk.chat.completions.create(model=MODEL, messages=[ASK], tools=[WEATHER], max_tokens=64, stream=True,
                                         tool_choice={"type": "function", "function": {"name": "get_weather"}})
    chunks = list(stream)
    pieces = [tc for ch in chunks for tc in ch.choices[0].delta.tool_calls or []]
    assert pieces[0].id and pieces[0].function and pieces[0].function.name == "get_weather"
    _check_call("get_weather", "".join(p.function.arguments or "" for p in pieces if p.function))
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_grpcurl_through_envoy(e2e_mesh: Mesh) -> None:
    body = {"model": MODEL, "messages": [ASK],
            "tools": [{"name": "get_weather", "parameters_json": json.dumps(PARAMETERS)}],
            "tool_choice": {"mode": "required"}, "sampling": {"max_tokens": 64}}
    out = subprocess.run([GRPCURL, "-plaintext", "-H", f"authorization: Bearer {e2e_mesh.api_key}", "-d",
                          json.dumps(body), e2e_mesh.endpoints.public_grpc, "kvmesh.v1.Inference/Chat"],
                         capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    decoder, events, rest = json.JSONDecoder(), [], out.stdout.strip()
    while rest:
        event, end = decoder.raw_decode(rest)
        events.append(event)
        rest = rest[end:].strip()
    pieces = [e["tool_call"] for e in events if "tool_call" in e]
    assert pieces[0]["name"] == "get_weather" and pieces[0]["id"].startswith("call_")
    assert sum("id" in p for p in pieces) == 1  # the sim's minimal instance: one call
    _check_call("get_weather", "".join(p.get("arguments", "") for p in pieces))
    assert events[-1]["finished"]["finish_reason"] == "FINISH_REASON_TOOL_CALLS"


def test_browser_bridge_carries_tool_calls(e2e_mesh: Mesh) -> None:
    """POST /v1/chat: Envoy's transcoder turns the gRPC stream into SSE."""
    body: dict[str, Any] = {"model": MODEL, "messages": [ASK],
                            "tools": [{"name": "get_weather", "parametersJson": json.dumps(PARAMETERS)}],
                            "toolChoice": {"function": "get_weather"}, "sampling": {"maxTokens": 64}}
    resp = requests.post(f"{e2e_mesh.endpoints.public_http}/v1/chat", json=body, timeout=60, stream=True,
                         headers={"Authorization": f"Bearer {e2e_mesh.api_key}", "Accept": "text/event-stream"})
    assert resp.status_code == 200, resp.text
    events = [json.loads(line[len("data: "):]) for line in resp.iter_lines(decode_unicode=True)
              if line and line.startswith("data: ")]  # type: ignore[arg-type]  # types-requests: iter_lines(decode_unicode=True) yields str
    pieces = [e.get("toolCall") or e.get("tool_call") for e in events if "toolCall" in e or "tool_call" in e]
    assert pieces and pieces[0]["name"] == "get_weather"
    _check_call("get_weather", "".join(p.get("arguments", "") for p in pieces))
    finished = events[-1]["finished"]
    assert (finished.get("finishReason") or finished.get("finish_reason")) == "FINISH_REASON_TOOL_CALLS"
