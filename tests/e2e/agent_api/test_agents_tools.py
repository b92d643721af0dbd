"""Tool calling on real vLLM engines (SmolLM2-135M-Instruct, whose template
has no tool support: kvmesh's generic tool prompt), through Envoy, with the
official `openai` SDK: `tool_choice` required gives valid calls (the output
is constrained to the tools' schemas), the tool's result goes back, the
model answers -- streamed and not. And the `openai-agents` package on the
chat-completions API (`OpenAIChatCompletionsModel`): an agent with one
function tool, forced to call it, runs to completion."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from jsonschema import Draft202012Validator

from .conftest import AGENT_MODEL, run_openai_agent

pytestmark = [pytest.mark.vllm, pytest.mark.e2e, pytest.mark.timeout(600)]

WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 40}, "unit": {"type": "string", "enum": ["C", "F"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.", "parameters": WEATHER_PARAMETERS}}
ASK = {"role": "user", "content": "What is the weather in Paris, in Celsius?"}
GRPCURL = str(Path(sys.prefix) / "bin" / "grpcurl")


def _streamed(client: Any, **request: Any) -> tuple[str, list[dict[str, Any]], str | None]:
    """A streamed chat folded into (content, tool calls, finish_reason),
    checking each tool-call delta has OpenAI's shape."""
    content, calls, reason = "", [], None
    for chunk in client.chat.completions.create(stream=True, **request):
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for delta in choice.delta.tool_calls or []:
            if delta.id is not None:  # a call's first delta: id, type, name, arguments ""
                assert delta.index == len(calls) and delta.type == "function" and delta.function.name
                assert delta.function.arguments == ""
                calls.append({"id": delta.id, "type": "function",
                              "function": {"name": delta.function.name, "arguments": ""}})
            else:
                assert delta.index == len(calls) - 1 and delta.function.name is None
                calls[delta.index]["function"]["arguments"] += delta.function.arguments
        reason = choice.finish_reason or reason
    return content, calls, reason


def _whole(client: Any, **request: Any) -> tuple[str, list[dict[str, Any]], str | None]:
    out = client.chat.completions.create(**request)
    message = out.choices[0].message
    calls = [c.model_dump(exclude_none=True) for c in message.tool_calls or []]
    if calls:
        assert message.content is None
    return message.content or "", calls, out.choices[0].finish_reason


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_required_tool_call_round_trip(openai_client: Any, stream: bool) -> None:
    ask = _streamed if stream else _whole
    # Greedy: sampled, the 135M model sometimes went on to call again and again until max_tokens
    # (finish_reason "length", rightly -- a CI failure). Parallel calls stay allowed: the output is an array.
    request = {"model": AGENT_MODEL, "tools": [WEATHER], "max_tokens": 200, "temperature": 0}
    _, calls, reason = ask(openai_client, messages=[ASK], tool_choice="required", **request)
    assert reason == "tool_calls" and calls
    for call in calls:
        assert call["id"].startswith("call_") and call["function"]["name"] == "get_weather"
        Draft202012Validator(WEATHER_PARAMETERS).validate(json.loads(call["function"]["arguments"]))
    results = [{"role": "tool", "tool_call_id": c["id"], "content": json.dumps({"temperature": 21, "sky": "sunny"})}
               for c in calls]
    history = [ASK, {"role": "assistant", "content": None, "tool_calls": calls}, *results]
    # The answer: the model may not call again (tool_choice none) and says something.
    content, again, reason = ask(openai_client, messages=history, tool_choice="none", **request)
    assert not again and reason in ("stop", "length") and content.strip()


def test_named_tool_choice_gives_one_valid_call(openai_client: Any) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    _, calls, reason = _whole(openai_client, model=AGENT_MODEL, messages=[ASK], tools=[WEATHER], tool_choice=named,
                              max_tokens=120)
    assert reason == "tool_calls" and len(calls) == 1
    Draft202012Validator(WEATHER_PARAMETERS).validate(json.loads(calls[0]["function"]["arguments"]))


def test_openai_agents_on_chat_completions(agents_mesh: Any) -> None:
    """openai-agents (PyPI) on chat completions (OpenAIChatCompletionsModel)."""
    run_openai_agent(agents_mesh, "chat")


def test_grpcurl_tool_call_through_envoy(agents_mesh: Any) -> None:
    """The README's grpcurl example: a forced call comes back as tool_call events."""
    body = {
        "model": AGENT_MODEL,
        "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
        "tools": [{"name": "get_weather", "description": "The current weather in a city",
                   "parameters_json": json.dumps(WEATHER_PARAMETERS)}],
        "tool_choice": {"mode": "required"},
        # One call, greedy: at temperature 1 the 135M model sometimes went on to a second call
        # and ran out of tokens in it -- FINISH_REASON_LENGTH, rightly (CI saw it once).
        "parallel_tool_calls": False,
        "sampling": {"temperature": 0, "max_tokens": 120},
    }
    out = subprocess.run([GRPCURL, "-plaintext", "-H", f"authorization: Bearer {agents_mesh.api_key}",
                          "-d", json.dumps(body), agents_mesh.endpoints.public_grpc, "kvmesh.v1.Inference/Chat"],
                         capture_output=True, text=True, timeout=180, check=False)
    assert out.returncode == 0, out.stderr
    decoder, events, rest = json.JSONDecoder(), [], out.stdout.strip()
    while rest:
        event, end = decoder.raw_decode(rest)
        events.append(event)
        rest = rest[end:].strip()
    pieces = [e["tool_call"] for e in events if "tool_call" in e]  # grpcurl prints the proto's field names
    assert pieces and pieces[0]["id"].startswith("call_") and pieces[0]["name"] == "get_weather"
    calls: list[str] = []
    for piece in pieces:
        if "id" in piece:
            calls.append("")
        calls[-1] += piece.get("arguments", "")
    for arguments in calls:
        Draft202012Validator(WEATHER_PARAMETERS).validate(json.loads(arguments))
    assert events[-1]["finished"]["finish_reason"] == "FINISH_REASON_TOOL_CALLS"
