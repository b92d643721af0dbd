"""`/v1/responses` on a gateway wired to a fake scheduler and engine, driven
by the official `openai` SDK: the Response object, the typed event stream as
the SDK parses it, the store (previous_response_id, GET, DELETE, key scoping)
and the OpenAI-shaped errors."""

from __future__ import annotations

import json

import aiohttp
import openai
import pytest
from conftest import KEY_FULL, KEY_P1, MODEL, Mesh, expected_answer

from services.common.proto.kvmesh.v1 import scheduler_pb2


def client(mesh: Mesh, key: str = KEY_FULL) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{mesh.http}/v1", api_key=key, max_retries=0, timeout=20)


async def test_create_returns_a_response_object(mesh: Mesh) -> None:
    mesh.engines["engine-a"].cached_tokens = 3
    async with client(mesh) as c:
        out = await c.responses.create(model=MODEL, input="hello world", instructions="be brief",
                                       max_output_tokens=50, temperature=0.5, metadata={"k": "v"})
    sent = mesh.engines["engine-a"].requests[0]
    _, text = expected_answer(list(sent.prompt_token_ids), 6)
    assert out.id.startswith("resp_") and out.object == "response" and out.status == "completed"
    assert out.output_text == text
    assert out.output[0].type == "message" and out.output[0].role == "assistant"
    assert out.output[0].content[0].type == "output_text"
    assert out.usage.input_tokens == len(sent.prompt_token_ids) and out.usage.output_tokens == 6
    assert out.usage.total_tokens == out.usage.input_tokens + 6
    assert out.usage.input_tokens_details.cached_tokens == 3
    assert out.instructions == "be brief" and out.metadata == {"k": "v"} and out.store is False  # type: ignore[attr-defined]  # the SDK's Response model has no `store`; the API returns it
    assert sent.sampling.max_tokens == 50 and sent.sampling.temperature == pytest.approx(0.5)
    # The same admission as chat: the scheduler saw it as a chat request of this key's tenant.
    assert mesh.scheduler.admits[0].request.tenant == "acme"


async def test_max_output_tokens_makes_it_incomplete(mesh: Mesh) -> None:
    async with client(mesh) as c:
        out = await c.responses.create(model=MODEL, input="hello world", max_output_tokens=2)
    assert out.status == "incomplete" and out.incomplete_details.reason == "max_output_tokens"
    assert out.usage.output_tokens == 2


async def test_stream_yields_the_typed_events_in_order(mesh: Mesh) -> None:
    async with client(mesh) as c:
        stream = await c.responses.create(model=MODEL, input=[{"role": "user", "content": "hello world"}],
                                          stream=True)
        events = [event async for event in stream]
    kinds = [e.type for e in events]
    assert kinds[:5] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added", "response.output_text.delta"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    sent = mesh.engines["engine-a"].requests[0]
    _, text = expected_answer(list(sent.prompt_token_ids), 6)
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == text
    done = events[-1].response
    assert done.status == "completed" and done.output_text == text and done.usage.output_tokens == 6
    assert events[0].response.status == "in_progress" and events[0].response.id == done.id


async def test_sse_frames_carry_event_names(mesh: Mesh) -> None:
    body = {"model": MODEL, "input": "hi", "stream": True}
    async with aiohttp.ClientSession() as s, s.post(
        f"{mesh.http}/v1/responses", json=body, headers={"Authorization": f"Bearer {KEY_FULL}"},
    ) as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
        raw = (await r.read()).decode()
    frames = [f for f in raw.split("\n\n") if f.startswith("event: ")]
    for frame in frames:
        name, data = frame.split("\n", 1)
        assert json.loads(data.removeprefix("data: "))["type"] == name.removeprefix("event: ")
    assert frames[-1].startswith("event: response.completed")


async def test_previous_response_id_continues_a_stored_response(mesh: Mesh) -> None:
    async with client(mesh) as c:
        first = await c.responses.create(model=MODEL, input="hello world", store=True)
        second = await c.responses.create(model=MODEL, input="again", previous_response_id=first.id)
        fetched = await c.responses.retrieve(first.id)
    one, two = mesh.engines["engine-a"].requests
    # The continuation's prompt starts with the first turn and its answer.
    assert len(two.prompt_token_ids) > len(one.prompt_token_ids) + 6
    assert second.previous_response_id == first.id
    assert fetched.id == first.id and fetched.output_text == first.output_text


async def test_unknown_previous_response_is_a_404_naming_the_param(mesh: Mesh) -> None:
    async with client(mesh) as c:
        unstored = await c.responses.create(model=MODEL, input="hello world")  # store defaults to false
        for missing in ("resp_nope", unstored.id):
            with pytest.raises(openai.NotFoundError) as err:
                await c.responses.create(model=MODEL, input="x", previous_response_id=missing)
            assert err.value.body["param"] == "previous_response_id"
            assert err.value.body["type"] == "invalid_request_error"
    assert len(mesh.engines["engine-a"].requests) == 1  # refused before queueing


async def test_stored_responses_belong_to_their_key(mesh: Mesh) -> None:
    async with client(mesh) as c:
        first = await c.responses.create(model=MODEL, input="hello world", store=True)
    async with client(mesh, KEY_P1) as other:
        with pytest.raises(openai.NotFoundError):
            await other.responses.retrieve(first.id)
        with pytest.raises(openai.NotFoundError):
            await other.responses.create(model=MODEL, input="x", previous_response_id=first.id)
        with pytest.raises(openai.NotFoundError):
            await other.responses.delete(first.id)
    async with client(mesh) as c:
        await c.responses.delete(first.id)
        with pytest.raises(openai.NotFoundError):
            await c.responses.retrieve(first.id)


@pytest.mark.parametrize(("extra", "param"), [
    ({"conversation": "conv_1"}, "conversation"),
    ({"background": True}, "background"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"text": {"format": {"type": "yaml"}}}, "text.format.type"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"max_output_tokens": 10**6}, "max_output_tokens"),
    ({"temperature": 9}, "temperature"),
    ({"bogus": 1}, "bogus"),
    ({"input": [{"type": "input_image"}]}, "input[0].type"),
])
async def test_bad_requests_are_400s_naming_the_param(mesh: Mesh, extra: dict[str, object], param: str) -> None:
    body = {"model": MODEL, "input": "hello", **extra}
    async with aiohttp.ClientSession() as s, s.post(
        f"{mesh.http}/v1/responses", json=body, headers={"Authorization": f"Bearer {KEY_FULL}"},
    ) as r:
        assert r.status == 400, await r.text()
        error = (await r.json())["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert mesh.engines["engine-a"].requests == []


async def test_scheduler_refusal_keeps_its_status_on_a_stream(mesh: Mesh) -> None:
    mesh.scheduler.reject = scheduler_pb2.Rejected(code=scheduler_pb2.REJECT_CODE_QUEUE_FULL, message="full")
    async with client(mesh) as c:
        with pytest.raises(openai.RateLimitError):
            await c.responses.create(model=MODEL, input="hello", stream=True)


async def test_a_forced_tool_is_constrained_on_the_engine(mesh: Mesh) -> None:
    tool = {"type": "function", "name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
    async with client(mesh) as c:
        out = await c.responses.create(model=MODEL, input="weather in Paris?", tools=[tool],
                                       tool_choice={"type": "function", "name": "get_weather"})
    sent = mesh.engines["engine-a"].requests[0]
    assert sent.sampling.HasField("structured")  # the tools path's constraint reached the engine
    assert "get_weather" in sent.sampling.structured.value
    # The fake engine ignores it: its words are not a call, so they are the text.
    assert out.status == "completed" and out.output[0].type == "message"


async def test_openai_agents_requests_are_accepted(mesh: Mesh) -> None:
    """What openai-agents sends (include=[], strict tool schemas, tool_choice
    required) is served; the fake engine answers with words, not a call, so
    the run ends with that text."""
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        return f"Sunny in {city}"

    async with client(mesh) as c:
        agent = agents.Agent(name="weather", instructions="Use the tool.", tools=[get_weather],
                             model=agents.OpenAIResponsesModel(model=MODEL, openai_client=c),
                             model_settings=agents.ModelSettings(tool_choice="required"),
                             tool_use_behavior="stop_on_first_tool")
        result = await agents.Runner.run(agent, "weather in Paris?", max_turns=1)
        streamed = agents.Runner.run_streamed(agent, "weather in Rome?", max_turns=1)
        kinds = [event.type async for event in streamed.stream_events()]
    assert result.final_output.startswith(" w")
    assert "raw_response_event" in kinds and streamed.final_output.startswith(" w")
