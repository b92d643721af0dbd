"""Tool calling in OpenAI bodies: every accepted shape normalized, every
malformed one a 400 naming the parameter, and the schema a forced
tool_choice constrains the output to."""

from __future__ import annotations

import json
from typing import Any

import pytest
from jsonschema import Draft202012Validator

from services.common.openai_api.errors import ApiError, ErrorKind
from services.common.openai_api.requests import parse_chat_body, parse_completion_body
from services.common.tool_calling.request import ToolRequest, parse_tool_choice, parse_tools, tool_call_schema

MSG = [{"role": "user", "content": "weather in Paris?"}]
WEATHER: dict[str, Any] = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"]}}}


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "messages": MSG, **fields}


def test_tools_are_normalized_with_auto_by_default() -> None:
    bare = {"type": "function", "function": {"name": "ping"}}
    g = parse_chat_body(chat(tools=[WEATHER, bare]))
    assert g.tool_choice == "auto" and g.parallel_tool_calls is True and g.structured is None
    assert g.tools is not None and g.tools[0] == {"type": "function", "function": {
        **WEATHER["function"], "strict": False}}
    assert g.tools[1]["function"] == {"name": "ping", "description": "", "strict": False,
                                      "parameters": {"type": "object", "properties": {}}}


def test_no_tools_means_none_and_empty_list_is_no_tools() -> None:
    assert parse_chat_body(chat()).tool_choice == "none"
    g = parse_chat_body(chat(tools=[], tool_choice="auto"))
    assert g.tools is None and g.tool_choice == "auto"


@pytest.mark.parametrize("choice", ["none", "auto", "required"])
def test_string_choices(choice: str) -> None:
    assert parse_chat_body(chat(tools=[WEATHER], tool_choice=choice)).tool_choice == choice


def test_named_choice_and_parallel_flag() -> None:
    g = parse_chat_body(chat(tools=[WEATHER, TIME], parallel_tool_calls=False,
                             tool_choice={"type": "function", "function": {"name": "get_time"}}))
    assert g.tool_choice == {"type": "function", "function": {"name": "get_time"}}
    assert g.parallel_tool_calls is False


def test_history_tool_calls_and_results() -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}
    g = parse_chat_body(chat(messages=[*MSG, {"role": "assistant", "content": None, "tool_calls": [call]},
                                       {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]))
    assert g.messages is not None
    assert g.messages[1] == {"role": "assistant", "content": "", "tool_calls": [call]}
    assert g.messages[2] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}


_BAD = [
    # (fields, param)
    ({"tools": {"type": "function"}}, "tools"),
    ({"tools": ["get_weather"]}, "tools[0]"),
    ({"tools": [WEATHER, {"type": "code_interpreter"}]}, "tools[1].type"),
    ({"tools": [{"type": "function"}]}, "tools[0].function"),
    ({"tools": [{"type": "function", "function": "f"}]}, "tools[0].function"),
    ({"tools": [WEATHER, {"type": "function", "function": {"description": "x"}}]}, "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "x" * 65}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": 7}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "description": 3}}]}, "tools[0].function.description"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "{}"}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                              "properties": 5}}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": "yes"}}]}, "tools[0].function.strict"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]}, "tools"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": 1}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function"}}, "tool_choice.function"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {}}}, "tool_choice.function.name"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, "tool_choice.function.name"),
    ({"tools": [WEATHER], "tool_choice": {"type": "file_search"}}, "tool_choice"),
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"functions": [WEATHER["function"]]}, "functions"),
    ({"function_call": "auto"}, "function_call"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
]

_CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
_BAD_MESSAGES = [
    ({"role": "user", "content": "x", "tool_calls": [_CALL]}, "messages[1].tool_calls"),
    ({"role": "assistant", "tool_calls": "f()"}, "messages[1].tool_calls"),
    ({"role": "assistant", "tool_calls": ["f"]}, "messages[1].tool_calls[0]"),
    ({"role": "assistant", "tool_calls": [{**_CALL, "id": ""}]}, "messages[1].tool_calls[0].id"),
    ({"role": "assistant", "tool_calls": [{**_CALL, "type": "code"}]}, "messages[1].tool_calls[0].type"),
    ({"role": "assistant", "tool_calls": [{"id": "c", "function": None}]}, "messages[1].tool_calls[0].function"),
    ({"role": "assistant", "tool_calls": [{"id": "c", "function": {"arguments": "{}"}}]},
     "messages[1].tool_calls[0].function.name"),
    ({"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": {"a": 1}}}]},
     "messages[1].tool_calls[0].function.arguments"),
    ({"role": "tool", "content": "sunny"}, "messages[1].tool_call_id"),
    ({"role": "tool", "content": "sunny", "tool_call_id": 5}, "messages[1].tool_call_id"),
    ({"role": "user", "content": "x", "tool_call_id": "call_1"}, "messages[1].tool_call_id"),
]


@pytest.mark.parametrize(("fields", "param"), _BAD + [({"messages": [*MSG, m]}, p) for m, p in _BAD_MESSAGES])
def test_every_malformed_form_is_a_400_naming_the_parameter(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiError) as err:
        parse_chat_body(chat(**fields))
    assert err.value.kind is ErrorKind.INVALID_REQUEST
    assert err.value.param == param, err.value.message
    assert param.split(".")[0].split("[")[0] in err.value.message


def test_completions_refuse_tools() -> None:
    with pytest.raises(ApiError) as err:
        parse_completion_body({"model": "m", "prompt": "hi", "tools": [WEATHER]})
    assert err.value.param == "tools"


def test_responses_flat_shapes() -> None:
    tools = parse_tools([{"type": "function", "name": "get_weather", "parameters": WEATHER["function"]["parameters"]}],
                        flat=True)
    assert tools[0]["function"]["name"] == "get_weather"
    assert parse_tool_choice({"type": "function", "name": "get_weather"}, tools, flat=True) == {
        "type": "function", "function": {"name": "get_weather"}}
    with pytest.raises(ApiError) as err:
        parse_tools([{"type": "function", "name": "a b"}], flat=True)
    assert err.value.param == "tools[0].name"


# ------------------------------------------------------------ enforcement schema


def _valid(schema: dict[str, Any], value: Any) -> bool:
    return Draft202012Validator(schema).is_valid(value)


def test_auto_and_none_set_no_constraint() -> None:
    for choice in ("auto", "none"):
        assert tool_call_schema(ToolRequest([WEATHER], choice)) is None


def test_required_parallel_is_a_non_empty_array_of_calls() -> None:
    g = parse_chat_body(chat(tools=[WEATHER, TIME], tool_choice="required"))
    assert g.structured is not None and g.structured.kind == "json_schema"
    schema = json.loads(g.structured.value)
    Draft202012Validator.check_schema(schema)
    assert _valid(schema, [{"name": "get_weather", "arguments": {"city": "Paris"}},
                           {"name": "get_time", "arguments": {"zone": "UTC"}}])
    assert not _valid(schema, [])
    assert not _valid(schema, {"name": "get_weather", "arguments": {"city": "Paris"}})
    assert not _valid(schema, [{"name": "get_time", "arguments": {"city": "Paris"}}])
    assert not _valid(schema, [{"name": "other", "arguments": {}}])


def test_required_without_parallel_is_exactly_one_call() -> None:
    schema = tool_call_schema(ToolRequest([WEATHER, TIME], "required", parallel_tool_calls=False))
    assert schema is not None
    assert _valid(schema, {"name": "get_time", "arguments": {"zone": "CET"}})
    assert not _valid(schema, {"name": "get_time", "arguments": {"zone": "PST"}})
    assert not _valid(schema, [{"name": "get_time", "arguments": {"zone": "CET"}}])


def test_named_function_is_one_call_of_it() -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    g = parse_chat_body(chat(tools=[WEATHER, TIME], tool_choice=named))
    assert g.structured is not None
    schema = json.loads(g.structured.value)
    assert _valid(schema, {"name": "get_weather", "arguments": {"city": "Oslo"}})
    assert not _valid(schema, {"name": "get_time", "arguments": {"zone": "UTC"}})
    assert not _valid(schema, {"name": "get_weather", "arguments": {}})
