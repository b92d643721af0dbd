"""Run in a process of its own by test_agents_responses.py and
test_agents_tools.py: the `openai-agents` package (PyPI, imported as
`agents`) runs an agent with one forced function tool against kvmesh, on the
Responses API (`OpenAIResponsesModel`, the SDK's default) or on chat
completions (`OpenAIChatCompletionsModel`: tools, tool_choice, tool calls and
results in the history), and prints what happened as JSON. A process of its
own: the SDK keeps global state (tracing, default client) a test run must not
share.

    python openai_agents_run.py BASE_URL API_KEY MODEL responses|chat
"""

from __future__ import annotations

import asyncio
import json
import sys

from agents import (
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from openai import AsyncOpenAI

cities: list[str] = []


@function_tool
def get_weather(city: str) -> str:
    """The current weather in a city."""
    cities.append(city)
    return f"Sunny in {city}"


def _agent(api: str, model: str, client: AsyncOpenAI) -> Agent:
    if api == "responses":
        settings = ModelSettings(tool_choice="required", temperature=0)
        chosen: OpenAIResponsesModel | OpenAIChatCompletionsModel = OpenAIResponsesModel(
            model=model, openai_client=client)
    else:
        # Greedy, as the Responses run and the grpcurl test: at temperature 1 the 135M model
        # failed this run once in five (a fresh-clone rerun on 2026-12-04).
        settings = ModelSettings(tool_choice="required", parallel_tool_calls=False, max_tokens=120, temperature=0)
        chosen = OpenAIChatCompletionsModel(model=model, openai_client=client)
    return Agent(name="weather", instructions="Use the get_weather tool to answer.", tools=[get_weather],
                 model=chosen, model_settings=settings, tool_use_behavior="stop_on_first_tool")


async def main(base_url: str, api_key: str, model: str, api: str) -> dict[str, object]:
    set_tracing_disabled(True)  # no trace export to api.openai.com
    client = AsyncOpenAI(base_url=base_url, api_key=api_key, timeout=120.0, max_retries=0)
    agent = _agent(api, model, client)
    try:
        result = await Runner.run(agent, "What is the weather in Paris?", max_turns=3)
        streamed = Runner.run_streamed(agent, "What is the weather in Rome?", max_turns=3)
        events = [event.type async for event in streamed.stream_events()]
    finally:
        await client.close()
    return {"cities": cities, "final_output": result.final_output,
            "items": [item.type for item in result.new_items],
            "streamed_output": streamed.final_output, "streamed_events": sorted(set(events))}


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(*sys.argv[1:5]))))
