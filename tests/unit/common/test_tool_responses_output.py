"""A Responses request's output split by the chat path's tool-call parser into
output items, however the text arrives."""

from __future__ import annotations

import json

import pytest

from services.common.openai_api.requests import GenerationInput, parse_chat_body
from services.common.openai_api.responses_events import ResponseBuilder
from services.common.tool_calling.responses_output import PlainText, ToolSplitter, splitter_for
from services.gateway.events import Usage

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]


def generation(**fields: object) -> GenerationInput:
    return parse_chat_body({"model": "m", "messages": [{"role": "user", "content": "x"}], **fields})


def run(text: str, step: int, **fields: object) -> list[dict[str, object]]:
    splitter = splitter_for(generation(**fields), "hermes")
    builder = ResponseBuilder("resp_1", "m", {})
    for i in range(0, len(text), step):
        for piece in splitter.feed(text[i:i + step]):
            if isinstance(piece, str):
                builder.text(piece)
            else:
                builder.tool_call(piece.index, piece.call_id, piece.name, piece.arguments)
    for piece in splitter.finish():
        assert not isinstance(piece, str) or piece
        if isinstance(piece, str):
            builder.text(piece)
        else:
            builder.tool_call(piece.index, piece.call_id, piece.name, piece.arguments)
    builder.finish("stop", Usage(1, 1, 0))
    return builder.response()["output"]


def test_no_tools_is_plain_text() -> None:
    assert isinstance(splitter_for(generation(), "hermes"), PlainText)
    assert isinstance(splitter_for(generation(tools=TOOLS, tool_choice="none"), "hermes"),
                      PlainText)
    assert isinstance(splitter_for(generation(tools=TOOLS), "hermes"), ToolSplitter)


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_text_then_a_hermes_call(step: int) -> None:
    text = 'Let me check. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    message, call = run(text, step, tools=TOOLS)
    assert message["type"] == "message" and message["content"][0]["text"] == "Let me check."
    assert call["type"] == "function_call" and call["name"] == "get_weather"
    assert json.loads(call["arguments"]) == {"city": "Paris"} and call["call_id"].startswith("call_")


@pytest.mark.parametrize("step", [1, 7])
def test_a_forced_choice_reads_the_bare_json(step: int) -> None:
    text = '[{"name": "get_weather", "arguments": {"city": "A"}}, {"name": "get_weather", "arguments": {"city": "B"}}]'
    calls = run(text, step, tools=TOOLS, tool_choice="required")
    assert [json.loads(c["arguments"])["city"] for c in calls] == ["A", "B"]
    assert all(c["type"] == "function_call" for c in calls)
