"""The Responses API's event sequence and Response object, checked against
the official SDK's own types (`ResponseStreamEvent`, `Response`)."""

from __future__ import annotations

import json
from typing import Any

import openai
import pydantic
from openai.types.responses import Response, ResponseStreamEvent

from services.common.openai_api.responses_events import ResponseBuilder, event_sse
from services.gateway.events import Usage

USAGE = Usage(prompt_tokens=10, completion_tokens=4, cached_tokens=8)
SETTINGS: dict[str, Any] = {
    "instructions": None, "max_output_tokens": None, "temperature": 1.0, "top_p": 1.0, "tools": [],
            "tool_choice": "auto", "parallel_tool_calls": True, "text": {"format": {"type": "text"}},
            "truncation": "disabled"}
_EVENT = pydantic.TypeAdapter(ResponseStreamEvent)


def builder() -> ResponseBuilder:
    return ResponseBuilder("resp_1", "m", dict(SETTINGS), created_at=5)


def parsed(events: list[dict[str, Any]]) -> list[Any]:
    """Each event as the SDK's type (strict validation, not construct)."""
    return [_EVENT.validate_python(e) for e in events]


def test_text_events_in_order() -> None:
    b = builder()
    events = [*b.start(), *b.text("Hel"), *b.text(""), *b.text("lo"), *b.finish("stop", USAGE)]
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.completed"]
    assert [e["sequence_number"] for e in events] == list(range(10))
    typed = parsed(events)
    assert typed[6].text == "Hello" and typed[8].item.status == "completed"
    assert typed[2].item.content == [] and typed[0].response.output == []  # snapshots, not live objects
    final = typed[-1].response
    assert final.output_text == "Hello" and final.status == "completed"
    assert final.usage.input_tokens == 10 and final.usage.output_tokens == 4 and final.usage.total_tokens == 14
    assert final.usage.input_tokens_details.cached_tokens == 8
    Response.model_validate(b.response())


def test_text_then_a_tool_call() -> None:
    b = builder()
    events = [*b.text("ok"), *b.tool_call(0, "call_a", "get_weather", '{"city":'), *b.tool_call(0, None, None, '"P"}'),
              *b.finish("tool_calls", USAGE)]
    kinds = [e["type"] for e in events]
    assert kinds[kinds.index("response.output_item.done") + 1:] == [
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    typed = parsed(events)
    done = next(e for e in typed if e.type == "response.function_call_arguments.done")
    assert done.arguments == '{"city":"P"}' and done.output_index == 1
    call = typed[-1].response.output[1]
    assert (call.type, call.call_id, call.name, call.arguments, call.status) == (
        "function_call", "call_a", "get_weather", '{"city":"P"}', "completed")
    assert typed[-1].response.output[0].content[0].text == "ok"


def test_two_parallel_calls_get_their_own_items_and_call_ids() -> None:
    b = builder()
    b.tool_call(0, None, "f", "{}")
    b.tool_call(1, None, "g", "{}")
    b.finish("tool_calls", USAGE)
    first, second = b.response()["output"]
    assert (first["name"], second["name"]) == ("f", "g")
    assert first["call_id"].startswith("call_") and first["call_id"] != second["call_id"]
    assert first["id"] != second["id"]


def test_length_is_incomplete() -> None:
    b = builder()
    events = [*b.text("x"), *b.finish("length", USAGE)]
    final = parsed(events)[-1]
    assert final.type == "response.incomplete"
    assert final.response.status == "incomplete" and final.response.incomplete_details.reason == "max_output_tokens"
    assert final.response.output[0].status == "incomplete"


def test_a_failure_after_the_start() -> None:
    b = builder()
    events = [*b.start(), *b.text("x"), *b.fail("generation_failed", "engine lost")]
    final = parsed(events)[-1]
    assert final.type == "response.failed" and final.response.status == "failed"
    assert final.response.error.code == "server_error"  # OpenAI's closed set of codes
    assert final.response.error.message == "engine lost (generation_failed)"


def test_sse_frames_name_their_event() -> None:
    event = builder().start()[0]
    raw = event_sse(event).decode()
    assert raw.startswith("event: response.created\ndata: ") and raw.endswith("\n\n")
    assert json.loads(raw.split("data: ", 1)[1]) == event


def test_the_sdk_accepts_the_whole_object() -> None:
    b = ResponseBuilder("resp_2", "m", dict(SETTINGS), previous_response_id="resp_1", metadata={"a": "b"}, store=True)
    b.text("hi")
    b.finish("stop", USAGE)
    out = Response.model_validate(b.response())
    assert out.previous_response_id == "resp_1" and out.metadata == {"a": "b"} and out.store is True  # type: ignore[attr-defined]  # the SDK's Response model has no `store`; the API returns it
    assert isinstance(out, openai.types.responses.Response)
