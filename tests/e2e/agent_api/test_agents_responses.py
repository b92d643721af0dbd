"""The Responses API on real vLLM engines (SmolLM2-135M-Instruct, two engines
behind Envoy): the official SDK's `responses.create`, streamed and not, a
function-tool round trip continued with `previous_response_id`, and the
`openai-agents` package running an agent with one function tool to the end
(`Runner.run` and `Runner.run_streamed`)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from services.launcher.mesh import Mesh

from .conftest import AGENT_MODEL, run_openai_agent

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

WEATHER_TOOL = {
    "type": "function", "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                   "additionalProperties": False},
    "strict": True,
}


def test_responses_create_not_streamed(openai_client: Any) -> None:
    out = openai_client.responses.create(model=AGENT_MODEL, input="Say hello.", instructions="Answer briefly.",
                                         max_output_tokens=16, temperature=0)
    assert out.id.startswith("resp_") and out.object == "response"
    assert out.status in ("completed", "incomplete")
    assert out.output_text.strip()
    assert out.usage.output_tokens > 0 and out.usage.input_tokens > 0


def test_responses_create_streams_the_typed_events(openai_client: Any) -> None:
    stream = openai_client.responses.create(model=AGENT_MODEL, input="Count to five.", max_output_tokens=24,
                                            temperature=0, stream=True)
    events = list(stream)
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert "response.output_text.delta" in kinds
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text and text == events[-1].response.output_text


def _call(response: Any) -> Any:
    calls = [item for item in response.output if item.type == "function_call"]
    assert calls, f"no function call in {response.output}"
    return calls[0]


def test_a_function_tool_round_trip_with_previous_response_id(openai_client: Any) -> None:
    first = openai_client.responses.create(
        model=AGENT_MODEL, input="What is the weather in Paris?", tools=[WEATHER_TOOL], tool_choice="required",
        temperature=0, store=True)
    call = _call(first)
    assert call.name == "get_weather"
    assert isinstance(json.loads(call.arguments)["city"], str)
    second = openai_client.responses.create(
        model=AGENT_MODEL, previous_response_id=first.id, tools=[WEATHER_TOOL], max_output_tokens=32,
        temperature=0, input=[{"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 24 C"}])
    assert second.previous_response_id == first.id
    assert second.output_text.strip()
    # The continuation's prompt held the first turn, its call and the result.
    assert second.usage.input_tokens > first.usage.input_tokens


def test_a_forced_tool_call_streams_argument_deltas(openai_client: Any) -> None:
    events = list(openai_client.responses.create(
        model=AGENT_MODEL, input="What is the weather in Rome?", tools=[WEATHER_TOOL],
        tool_choice={"type": "function", "name": "get_weather"}, temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.delta" in kinds and kinds[-1] == "response.completed"
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert done.arguments == deltas and isinstance(json.loads(deltas)["city"], str)


def test_openai_agents_runs_an_agent_with_a_function_tool(agents_mesh: Mesh) -> None:
    """openai-agents (PyPI) on the Responses API, its default."""
    run_openai_agent(agents_mesh, "responses")
