"""Structured outputs on real vLLM engines (SmolLM2-135M-Instruct, two
engines behind Envoy: tests/e2e/agent_api/conftest.py) with the official
`openai` SDK: `chat.completions.parse` with a pydantic model, a json_schema
stream, completions constrained by a regex and by a choice, and an invalid
schema refused before queueing."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from jsonschema import Draft202012Validator
from pydantic import BaseModel, Field

from services.launcher.mesh import Mesh

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

MODEL = "SmolLM2-135M-Instruct"
CITIES = ["Paris", "Tokyo", "Lima", "Cairo", "Oslo", "Quito", "Delhi", "Rome", "Accra", "Seoul"]


class City(BaseModel):
    name: str = Field(max_length=40)
    country: str = Field(max_length=40)
    population: int
    coastal: bool


def _ask(city: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Describe the city of {city} as JSON with name, country, population "
                                        "and whether it is coastal."}]


def _parse(client: Any, i: int) -> City:
    """Ask i's city (10 greedy, 10 sampled) with `parse`: it must end by
    itself ("stop") in a valid City."""
    sampled = i >= 10
    completion = client.chat.completions.parse(
        model=MODEL, messages=_ask(CITIES[i % 10]), response_format=City, max_tokens=300,
        temperature=0.8 if sampled else 0.0, seed=i if sampled else None)
    message = completion.choices[0].message
    assert completion.choices[0].finish_reason == "stop", message.content
    assert isinstance(message.parsed, City), message.content
    return message.parsed


def test_parse_returns_a_valid_pydantic_object_20_of_20(openai_client: Any) -> None:
    # All at once, as clients send them: the two engines batch them (one
    # after another they took ~50 s of a CI run); each is checked the same.
    with ThreadPoolExecutor(max_workers=20) as pool:
        parsed = list(pool.map(lambda i: _parse(openai_client, i), range(20)))
    assert len(parsed) == 20


def test_json_schema_stream_is_valid(openai_client: Any) -> None:
    schema = City.model_json_schema()
    stream = openai_client.chat.completions.create(
        model=MODEL, messages=_ask("Lisbon"), stream=True, max_tokens=300, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema, "strict": True}})
    pieces, finish = [], None
    for chunk in stream:
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert len([p for p in pieces if p]) >= 3 and finish == "stop"
    assert not list(Draft202012Validator(schema).iter_errors(json.loads("".join(pieces))))


def test_json_object_is_an_object(openai_client: Any) -> None:
    # A short answer: free-form objects from a 135M model can loop on keys until max_tokens.
    completion = openai_client.chat.completions.create(
        model=MODEL, max_tokens=200, temperature=0, response_format={"type": "json_object"},
        messages=[{"role": "user", "content": 'Reply with exactly this JSON and nothing else: {"ok": true}'}])
    choice = completion.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    assert isinstance(json.loads(choice.message.content), dict)


def test_completions_with_a_regex_and_a_choice(openai_client: Any) -> None:
    client = openai_client
    pattern = r"[A-Z]{3}-[0-9]{4}"
    out = client.completions.create(model=MODEL, prompt="A flight code:", max_tokens=20, temperature=0.7, seed=1,
                                    extra_body={"structured_outputs": {"regex": pattern}})
    assert re.fullmatch(pattern, out.choices[0].text), out.choices[0].text
    out = client.completions.create(model=MODEL, prompt="Is the sky blue? Answer:", max_tokens=10, temperature=0,
                                    extra_body={"structured_outputs": {"choice": ["yes", "no", "maybe"]}})
    assert out.choices[0].text in ("yes", "no", "maybe")


@pytest.mark.parametrize(("extra", "param"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format.json_schema.schema"),
    ({"extra_body": {"structured_outputs": {"regex": "[unclosed"}}}, "structured_outputs.regex"),
])
def test_invalid_constraint_is_a_400(openai_client: Any, extra: dict[str, Any], param: str) -> None:
    openai = pytest.importorskip("openai")
    with pytest.raises(openai.BadRequestError) as info:
        openai_client.chat.completions.create(model=MODEL, messages=_ask("x"), max_tokens=5, **extra)
    assert info.value.body["param"] == param


def test_a_schema_xgrammar_cannot_compile_is_a_400_before_any_token(openai_client: Any,
                                                                    agents_mesh: Mesh) -> None:
    """Valid draft 2020-12 (so the gateway passes it) but its $ref points
    nowhere: the engine's xgrammar refuses it before any token -> 400."""
    openai = pytest.importorskip("openai")
    schema = {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}, "required": ["a"]}
    with pytest.raises(openai.BadRequestError) as info:
        list(openai_client.chat.completions.create(
            model=MODEL, messages=_ask("x"), max_tokens=5, stream=True,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}))
    assert "refused" in str(info.value) or "schema" in str(info.value)
