"""Run by test_agents_responses.py in a process of its own: the `openai-agents`
package (PyPI, imported as `agents`, a name this test package shadows inside
pytest) runs an agent with one function tool against kvmesh, and prints what
happened as JSON.

    python openai_agents_run.py BASE_URL API_KEY MODEL
"""

from __future__ import annotations

import asyncio
import json
import sys

from openai import AsyncOpenAI

from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled

cities: list[str] = []


@function_tool
def get_weather(city: str) -> str:
    """The current weather in a city."""
    cities.append(city)
    return f"Sunny in {city}"


async def main(base_url: str, api_key: str, model: str) -> dict[str, object]:
    set_tracing_disabled(True)
    client = AsyncOpenAI(base_url=base_url, api_key=api_key, timeout=120.0, max_retries=0)
    agent = Agent(
        name="weather", instructions="Use the get_weather tool to answer.", tools=[get_weather],
        model=OpenAIResponsesModel(model=model, openai_client=client),
        model_settings=ModelSettings(tool_choice="required", temperature=0),
        tool_use_behavior="stop_on_first_tool")
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
    print(json.dumps(asyncio.run(main(*sys.argv[1:4]))))
