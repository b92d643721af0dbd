"""The simulator's structured-output contract (services/engine/sim/structured.py):
one deterministic valid instance, continued exactly after a migration."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import pytest
from engine_helpers import make_core, prompt_of, request, run_core
from jsonschema import Draft202012Validator

from services.common.openai_api.structured_outputs import StructuredSpec
from services.engine.backend import GenerationOutput, GenerationRequest, InvalidRequest
from services.engine.sim.structured import minimal_instance, minimal_match

SCHEMAS: list[dict[str, Any]] = [
    {"type": "object", "properties": {"city": {"type": "string"}, "n": {"type": "integer", "minimum": 3}},
     "required": ["city", "n"]},
    {"type": "object", "properties": {"a": {"type": "string"}}},
    {"type": "array", "items": {"type": "number", "exclusiveMinimum": 1.5}, "minItems": 2},
    {"type": "string", "minLength": 8, "maxLength": 9},
    {"type": "string", "format": "date-time"},
    {"type": "string", "pattern": "^[a-f]{4}-[0-9]+$"},
    {"enum": ["red", "green"]},
    {"const": {"x": 1}},
    {"type": ["null", "boolean"]},
    {"type": "null"},
    {"type": "integer", "maximum": -4},
    {"anyOf": [{"type": "integer"}, {"type": "string"}]},
    {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
               {"properties": {"b": {"type": "boolean"}}, "required": ["b"]}]},
    {"$defs": {"pt": {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]}},
     "type": "object",
     "properties": {"p": {"$ref": "#/$defs/pt"},
                    "q": {"type": "array", "items": {"$ref": "#/$defs/pt"}, "minItems": 1}},
     "required": ["p", "q"]},
    {"type": "object", "properties": {"v": {"type": "array", "prefixItems": [{"type": "string"}, {"type": "integer"}]}},
     "required": ["v"]},
]


@pytest.mark.parametrize("schema", SCHEMAS)
def test_minimal_instance_is_valid(schema: dict[str, Any]) -> None:
    instance = minimal_instance(schema)
    assert not list(Draft202012Validator(schema).iter_errors(instance)), instance


@pytest.mark.parametrize("pattern", [r"\d{3}-[a-z]+", r"(ab|cd)?x*y+", r"[^0-9]{2}\.", r"^\w+@\w+\.com$",
                                     r"(?:foo|bar){2}", r"[A-Z][a-z]{2,5}\s\d"])
def test_minimal_match_matches(pattern: str) -> None:
    assert re.fullmatch(pattern, minimal_match(pattern))


def _run(req: GenerationRequest) -> GenerationOutput:
    core = make_core()
    sim = core.add(req)
    run_core(core)
    return asyncio.run(asyncio.wait_for(sim.sink.next(), 1))


def _structured(rid: str, spec: StructuredSpec, prompt: list[int], max_tokens: int = 200,
                resumed: int = 0, **kw: Any) -> GenerationRequest:
    req = request(rid, prompt, max_tokens=max_tokens, structured=spec, **kw)
    req.resumed_tokens = resumed
    return req


SCHEMA = SCHEMAS[0]


@pytest.mark.parametrize(("spec", "check"), [
    (StructuredSpec("json_schema", json.dumps(SCHEMA)),
     lambda t: not list(Draft202012Validator(SCHEMA).iter_errors(json.loads(t)))),
    (StructuredSpec("json_object"), lambda t: json.loads(t) == {}),
    (StructuredSpec("choice", '["left", "right"]'), lambda t: t == "left"),
    (StructuredSpec("regex", r"[A-Z]{2}\d{3}"), lambda t: re.fullmatch(r"[A-Z]{2}\d{3}", t)),
])
def test_a_constrained_request_emits_one_valid_instance_then_stops(spec: StructuredSpec, check: Any) -> None:
    out = _run(_structured("r", spec, prompt_of(20), temperature=1.0))
    assert out.finish_reason == "stop"
    assert check(out.text), out.text
    assert len(out.token_ids) == out.completion_tokens


def test_max_tokens_truncates_as_an_engine_would() -> None:
    out = _run(_structured("r", StructuredSpec("json_schema", json.dumps(SCHEMA)), prompt_of(20), max_tokens=3))
    assert out.finish_reason == "length" and len(out.token_ids) == 3


@pytest.mark.parametrize("cut", [1, 4, 9])
def test_resumed_request_continues_the_instance(cut: int) -> None:
    spec = StructuredSpec("json_schema", json.dumps(SCHEMA))
    prompt = prompt_of(20)
    whole = _run(_structured("w", spec, prompt))
    head = _run(_structured("h", spec, prompt, max_tokens=cut))
    rest = _run(_structured("t", spec, prompt + head.token_ids, resumed=cut))
    assert head.text + rest.text == whole.text
    assert head.token_ids + rest.token_ids == whole.token_ids
    assert rest.finish_reason == "stop" and rest.completion_tokens == len(whole.token_ids)


def test_resumed_tokens_that_are_not_the_instance_are_refused() -> None:
    spec = StructuredSpec("json_object")
    with pytest.raises(InvalidRequest, match="cannot continue"):
        make_core().add(_structured("x", spec, prompt_of(20) + [5, 6], resumed=2))


@pytest.mark.parametrize("spec", [
    StructuredSpec("grammar", 'root ::= "a"'),
    StructuredSpec("regex", r"(a)\1"),
    StructuredSpec("regex", r"a(?=b)"),
    StructuredSpec("json_schema", json.dumps({"$ref": "https://example.com/x.json"})),
])
def test_what_the_sim_cannot_generate_is_refused_before_any_token(spec: StructuredSpec) -> None:
    with pytest.raises(InvalidRequest):
        make_core().add(_structured("x", spec, prompt_of(20)))


def test_unconstrained_requests_are_unchanged() -> None:
    out = _run(request("u", prompt_of(20), max_tokens=8, ignore_eos=True))
    assert out.finish_reason == "length" and len(out.token_ids) == 8 and out.text.startswith(" ")
