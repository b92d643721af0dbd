"""A `/v1/responses` body -> the chat body it runs as, and every 400 it can
be refused with (naming the Responses parameter)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.common.openai_api.errors import ApiError
from services.common.openai_api.requests import parse_chat_body
from services.common.openai_api.responses_input import chat_body, parse_responses_body, responses_param
from services.common.openai_api.responses_items import items_to_messages, normalize_input


def body(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "input": "hi", **fields}


def chat_of(history: list[dict[str, Any]] | None = None, **fields: Any) -> dict[str, Any]:
    return chat_body(parse_responses_body(body(**fields)), history or [])


def test_a_string_input_is_one_user_message() -> None:
    assert chat_of()["messages"] == [{"role": "user", "content": "hi"}]


def test_instructions_lead_as_a_system_message() -> None:
    assert chat_of(instructions="be brief")["messages"][0] == {"role": "system", "content": "be brief"}


def test_message_items_with_text_parts() -> None:
    items = [
        {"role": "developer", "content": "rules"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"},
                                                         {"type": "input_text", "text": "b"}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "c", "annotations": []}]},
    ]
    assert chat_of(input=items)["messages"] == [
        {"role": "developer", "content": "rules"}, {"role": "user", "content": "ab"},
        {"role": "assistant", "content": "c"}]


def test_a_tool_round_trip_becomes_tool_calls_and_a_tool_message() -> None:
    items = [
        {"role": "user", "content": "weather?"},
        {"type": "message", "role": "assistant", "content": "let me look"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city":"Paris"}',
         "id": "fc_1", "status": "completed"},
        {"type": "function_call", "call_id": "call_2", "name": "get_time", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "noon"}]},
    ]
    assert chat_of(input=items)["messages"] == [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "let me look", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}},
            {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": "noon"},
    ]


def test_a_function_call_without_assistant_text_starts_its_own_message() -> None:
    messages = items_to_messages(normalize_input([
        {"role": "user", "content": "x"}, {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}]))
    assert messages[1] == {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}


def test_history_comes_before_the_new_input() -> None:
    history = normalize_input([{"role": "user", "content": "one"}, {"role": "assistant", "content": "two"}])
    assert [m["content"] for m in chat_of(history, input="three", instructions="sys")["messages"]] == [
        "sys", "one", "two", "three"]


def test_sampling_tools_and_format_map_to_chat_fields() -> None:
    tool = {"type": "function", "name": "f", "description": "d", "parameters": {"type": "object"}, "strict": True}
    chat = chat_of(max_output_tokens=9, temperature=0.2, top_p=0.5, tools=[tool], tool_choice="required",
                   parallel_tool_calls=False, seed=3,
                   text={"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}, "strict": True}})
    assert chat["max_completion_tokens"] == 9 and chat["temperature"] == 0.2 and chat["top_p"] == 0.5
    assert chat["seed"] == 3
    assert chat["tools"] == [{"type": "function", "function": {
        "name": "f", "description": "d", "parameters": {"type": "object"}, "strict": True}}]
    assert chat["tool_choice"] == "required" and chat["parallel_tool_calls"] is False
    assert chat["response_format"] == {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object"}, "strict": True}}
    named = chat_of(tools=[tool], tool_choice={"type": "function", "name": "f"})
    assert named["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    assert chat_of(text={"format": {"type": "json_object"}})["response_format"] == {"type": "json_object"}
    assert "response_format" not in chat_of(text={"format": {"type": "text"}})


def test_defaults_stateless_and_what_agents_send_is_accepted() -> None:
    parsed = parse_responses_body(body(include=[], truncation="disabled", reasoning=None, prompt_cache_key="k",
                                       user="u", service_tier="auto", stream_options={}))
    assert parsed.store is False and parsed.stream is False and parsed.previous_response_id is None
    assert parsed.settings["tool_choice"] == "auto" and parsed.settings["text"] == {"format": {"type": "text"}}


@pytest.mark.parametrize(("fields", "param"), [
    ({"model": None}, "model"),
    ({"input": 5}, "input"),
    ({"input": [5]}, "input[0]"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    ({"input": [{"role": "user"}]}, "input[0].content"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]}, "input[0].content[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_text"}]}]}, "input[0].content[0].text"),
    ({"input": [{"role": "user", "content": 3}]}, "input[0].content"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": {}}]}, "input[0].arguments"),
    ({"input": [{"type": "function_call_output", "call_id": "c"}]}, "input[0].output"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
    ({"input": [{"type": "weird"}]}, "input[0].type"),
    ({"input": []}, "input"),
    ({"instructions": 3}, "instructions"),
    ({"store": "yes"}, "store"),
    ({"stream": 1}, "stream"),
    ({"previous_response_id": ""}, "previous_response_id"),
    ({"metadata": {"k": 1}}, "metadata"),
    ({"metadata": {str(i): "v" for i in range(17)}}, "metadata"),
    ({"tools": "f"}, "tools"),
    ({"tools": [{"type": "web_search_preview"}]}, "tools[0].type"),
    ({"tools": [{"type": "function"}]}, "tools[0].name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "function", "name": "g"}},
     "tool_choice.name"),
    ({"tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "file_search"}}, "tool_choice"),
    ({"tools": [{"type": "function", "name": "f"}], "parallel_tool_calls": "no"}, "parallel_tool_calls"),
    ({"text": "json"}, "text"),
    ({"text": {"format": {"type": "grammar"}}}, "text.format.type"),
    ({"background": True}, "background"),
    ({"conversation": "c"}, "conversation"),
    ({"prompt": {"id": "p"}}, "prompt"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"max_tool_calls": 2}, "max_tool_calls"),
    ({"context_management": []}, "context_management"),
    ({"messages": []}, "messages"),
    ({"max_tokens": 3}, "max_tokens"),
    ({"response_format": {}}, "response_format"),
    ({"n": 2}, "n"),
    ({"frobnicate": 1}, "frobnicate"),
])
def test_every_refusal_names_its_param(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiError) as err:
        chat_of(**fields)
    assert err.value.param == param
    assert err.value.kind.value == "invalid_request"


def test_missing_input_is_a_missing_parameter() -> None:
    with pytest.raises(ApiError) as err:
        parse_responses_body({"model": "m"})
    assert (err.value.param, err.value.code) == ("input", "missing_required_parameter")


def test_background_false_is_accepted() -> None:
    assert parse_responses_body(body(background=False)).stream is False


@pytest.mark.parametrize(("chat", "responses"), [
    ("max_completion_tokens", "max_output_tokens"),
    ("messages", "input"),
    ("messages[3].content", "input"),
    ("response_format", "text.format"),
    ("response_format.json_schema.schema", "text.format.schema"),
    ("tools[2].function.parameters", "tools[2].parameters"),
    ("temperature", "temperature"),
    (None, None),
])
def test_chat_params_are_renamed(chat: str | None, responses: str | None) -> None:
    assert responses_param(chat) == responses


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=12)
_FIELDS = ["input", "instructions", "tools", "tool_choice", "text", "metadata", "store", "stream",
           "previous_response_id", "max_output_tokens", "temperature", "parallel_tool_calls", "include"]


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(_FIELDS), _JSON, max_size=4), st.lists(_JSON, max_size=3))
def test_any_body_is_parsed_or_refused_with_an_api_error(fields: dict[str, Any], items: list[Any]) -> None:
    """Nothing a client sends raises anything but an `ApiError` (a 400)."""
    try:
        parsed = parse_responses_body({"model": "m", "input": items, **fields})
        parse_chat_body(chat_body(parsed, []))
    except ApiError as exc:
        assert exc.kind.value == "invalid_request"
