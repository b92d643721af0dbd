"""Parsing a body's output constraint: every accepted form, every 400 and the
parameter it names (services/common/openai_api/structured_outputs.py)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from services.common.openai_api.errors import ApiError, ErrorKind
from services.common.openai_api.requests import parse_chat_body, parse_completion_body
from services.common.openai_api.structured_outputs import MAX_STRUCTURED_CHARS, StructuredSpec, check_structured

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def _chat(**extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **extra}


def _completion(**extra: Any) -> dict[str, Any]:
    return {"model": "m", "prompt": "hi", **extra}


ACCEPTED = [
    ({}, None),
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, StructuredSpec("json_object")),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}},
     StructuredSpec("json_schema", json.dumps(SCHEMA), strict=True)),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
     StructuredSpec("json_schema", json.dumps(SCHEMA))),
    ({"structured_outputs": {"json": SCHEMA}}, StructuredSpec("json_schema", json.dumps(SCHEMA))),
    ({"structured_outputs": {"json": json.dumps(SCHEMA)}}, StructuredSpec("json_schema", json.dumps(SCHEMA))),
    ({"structured_outputs": {"json_object": True}}, StructuredSpec("json_object")),
    ({"structured_outputs": {"regex": r"\d{3}-[a-z]+"}}, StructuredSpec("regex", r"\d{3}-[a-z]+")),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, StructuredSpec("choice", '["yes", "no"]')),
    ({"structured_outputs": {"grammar": 'root ::= "a" | "b"'}}, StructuredSpec("grammar", 'root ::= "a" | "b"')),
    ({"structured_outputs": {"choice": ["x"], "regex": None}}, StructuredSpec("choice", '["x"]')),
]


@pytest.mark.parametrize(("extra", "expected"), ACCEPTED)
@pytest.mark.parametrize("route", ["chat", "completion"])
def test_accepted(route: str, extra: dict[str, Any], expected: StructuredSpec | None) -> None:
    parsed = parse_chat_body(_chat(**extra)) if route == "chat" else parse_completion_body(_completion(**extra))
    assert parsed.structured == expected


BIG = "a" * (MAX_STRUCTURED_CHARS + 1)
REFUSED = [
    ({"response_format": "json"}, "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "structural_tag"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a b", "schema": SCHEMA}}},
     "response_format.json_schema.name"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA, "strict": "yes"}}},
     "response_format.json_schema.strict"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "bogus"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"properties": 5}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"description": BIG}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": ["a"]}, "structured_outputs"),
    ({"structured_outputs": {"regex": "("}}, "structured_outputs.regex"),
    ({"structured_outputs": {"regex": "a\x00"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"regex": 5}}, "structured_outputs.regex"),
    ({"structured_outputs": {"regex": BIG}}, "structured_outputs.regex"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {"choice": ["a", 1]}}, "structured_outputs.choice"),
    ({"structured_outputs": {"choice": "a"}}, "structured_outputs.choice"),
    ({"structured_outputs": {"choice": ["ok", "\ud800"]}}, "structured_outputs.choice"),
    ({"structured_outputs": {"json": {"type": "number", "maximum": float("nan")}}}, "structured_outputs.json"),
    ({"structured_outputs": {"grammar": "  "}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"json": "{nope"}}, "structured_outputs.json"),
    ({"structured_outputs": {"json": [1]}}, "structured_outputs.json"),
    ({"structured_outputs": {"json": {"type": 12}}}, "structured_outputs.json"),
    ({"structured_outputs": {"json_object": False}}, "structured_outputs.json_object"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag"),
    ({"structured_outputs": {"regex": "a", "disable_any_whitespace": True}},
     "structured_outputs.disable_any_whitespace"),
    ({"structured_outputs": {"regex": "a", "bogus": 1}}, "structured_outputs.bogus"),
    ({"guided_json": SCHEMA}, "guided_json"),
    ({"guided_regex": "a"}, "guided_regex"),
    ({"guided_choice": ["a"]}, "guided_choice"),
    ({"guided_grammar": "root ::= \"a\""}, "guided_grammar"),
    ({"guided_decoding_backend": "xgrammar"}, "guided_decoding_backend"),
]


@pytest.mark.parametrize(("extra", "param"), REFUSED)
@pytest.mark.parametrize("route", ["chat", "completion"])
def test_refused_names_the_param(route: str, extra: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiError) as caught:
        if route == "chat":
            parse_chat_body(_chat(**extra))
        else:
            parse_completion_body(_completion(**extra))
    assert caught.value.kind is ErrorKind.INVALID_REQUEST
    assert caught.value.param == param
    assert len(str(caught.value)) < 600  # a bounded message, even for a 64 KiB value


def test_schema_error_says_what_is_wrong() -> None:
    with pytest.raises(ApiError, match=r"not a valid JSON Schema.*'bogus' is not valid"):
        parse_chat_body(_chat(structured_outputs={"json": {"type": "bogus"}}))
    with pytest.raises(ApiError, match="at most 65536"):
        parse_chat_body(_chat(structured_outputs={"regex": BIG}))


@pytest.mark.parametrize(
    ("spec", "ok"),
    [
        (StructuredSpec("json_schema", json.dumps(SCHEMA)), True),
        (StructuredSpec("json_schema", "[]"), False),
        (StructuredSpec("json_schema", "{"), False),
        (StructuredSpec("json_object", "ignored"), True),
        (StructuredSpec("choice", '["a"]'), True),
        (StructuredSpec("choice", json.dumps(["a"] * 2000)), False),
        (StructuredSpec("choice", '{"a": 1}'), False),
        (StructuredSpec("regex", "[a-z]+"), True),
        (StructuredSpec("regex", "\ud800"), False),
        (StructuredSpec("grammar", ""), False),
    ],
)
def test_check_structured_as_grpc_uses_it(spec: StructuredSpec, ok: bool) -> None:
    if ok:
        assert check_structured(spec, "sampling.structured").kind == spec.kind
    else:
        with pytest.raises(ApiError) as caught:
            check_structured(spec, "sampling.structured")
        assert caught.value.param == "sampling.structured"


def test_a_checked_schema_is_answered_the_same_on_every_request() -> None:
    """The schema check is memoised (it costs milliseconds): a valid schema
    stays valid under any parameter name, and an invalid one is refused every
    time with the message for the parameter it came in."""
    valid = json.dumps({"type": "object", "properties": {"city": {"type": "string"}}})
    invalid_schema = json.dumps({"type": "object", "properties": {"city": {"type": 7}}})
    params = ("response_format.json_schema.schema", "tools[0].function.parameters",
              "response_format.json_schema.schema")
    for param in params:
        assert check_structured(StructuredSpec("json_schema", valid), param).value == valid
        with pytest.raises(ApiError) as refused:
            check_structured(StructuredSpec("json_schema", invalid_schema), param)
        assert refused.value.param == param
        assert "is not a valid JSON Schema" in refused.value.message
    for text in ("[1, 2]", "not json"):
        with pytest.raises(ApiError):
            check_structured(StructuredSpec("json_schema", text), "response_format")
