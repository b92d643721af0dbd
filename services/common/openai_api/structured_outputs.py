"""Structured outputs: the one constraint a request may put on its text.

`StructuredSpec` is what every layer carries: parsed from an OpenAI body
(`structured_from_body`, below), from the native gRPC API's
`SamplingParams.structured`, or set by the gateway itself (tool calling with
`tool_choice` required / a named function: services/common/tool_calling/); sent to
the engine in `SamplingParams.structured` (common.proto `StructuredOutput`,
one function each way here), and enforced there (vLLM:
StructuredOutputsParams, xgrammar; the simulator: a documented minimal
contract, services/engine/sim/structured.py).

An OpenAI body's output constraint -> one checked `StructuredSpec`, or a
400 naming the parameter.

Accepted, on chat and completions alike:

- `response_format`: `{"type": "text"}` (no constraint), `{"type":
  "json_object"}`, `{"type": "json_schema", "json_schema": {"name", "schema",
  "strict", "description"}}` (OpenAI's shapes);
- `structured_outputs`: vLLM 0.32's extra field, exactly one of `json`
  (a schema, as an object or JSON text), `regex`, `choice` (a list of
  strings), `grammar` (EBNF / Lark as xgrammar reads it), `json_object: true`.

At most one constraint per request: `response_format` (other than text)
together with `structured_outputs` is a 400, as is more than one key inside
`structured_outputs`. vLLM's removed `guided_json` / `guided_regex` /
`guided_choice` / `guided_grammar` fields (vLLM ignores them with a warning
and the output is NOT constrained) are a 400 here that names the
replacement, so no client believes its output is constrained when it is not.
vLLM's `structural_tag`, `disable_any_whitespace`,
`disable_additional_properties` and `whitespace_pattern` are not supported
(400).

`check_structured` is the one check every front door applies (HTTP here,
the native gRPC API in services/gateway/validation.py): size bounds, a JSON
schema valid under draft 2020-12 (`jsonschema`), a regex Python can compile,
a non-empty list of choices, a non-empty grammar. What only the engine's
grammar compiler can tell (a schema feature or regex construct xgrammar does
not support, an EBNF syntax error) the engine refuses before its first token
(INVALID_ARGUMENT), which the gateway answers as the same 400.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from typing import Any, Literal

from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError

from services.common.openai_api.errors import ApiError, ErrorKind
from services.common.proto.kvmesh.v1 import common_pb2

__all__ = [
    "MAX_CHOICES",
    "MAX_STRUCTURED_CHARS",
    "STRUCTURED_KINDS",
    "StructuredKind",
    "StructuredSpec",
    "check_structured",
    "structured_from_body",
    "structured_from_proto",
    "structured_to_proto",
]

StructuredKind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]
STRUCTURED_KINDS: tuple[StructuredKind, ...] = ("json_schema", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredSpec:
    """kind and its value: json_schema -> the schema as JSON text;
    json_object -> ""; regex -> the pattern; choice -> a JSON list of the
    strings; grammar -> EBNF text. `strict` is OpenAI's json_schema.strict
    (carried; the engine enforces the schema exactly either way)."""

    kind: StructuredKind
    value: str = ""
    strict: bool = False


_Kind = common_pb2.StructuredOutput.Kind
_TO_PROTO: dict[str, common_pb2.StructuredOutput.Kind] = {
    "json_schema": _Kind.KIND_JSON_SCHEMA,
    "json_object": _Kind.KIND_JSON_OBJECT,
    "regex": _Kind.KIND_REGEX,
    "choice": _Kind.KIND_CHOICE,
    "grammar": _Kind.KIND_GRAMMAR,
}
_FROM_PROTO: dict[common_pb2.StructuredOutput.Kind, StructuredKind] = {
    _Kind.KIND_JSON_SCHEMA: "json_schema",
    _Kind.KIND_JSON_OBJECT: "json_object",
    _Kind.KIND_REGEX: "regex",
    _Kind.KIND_CHOICE: "choice",
    _Kind.KIND_GRAMMAR: "grammar",
}


def structured_to_proto(spec: StructuredSpec) -> common_pb2.StructuredOutput:
    return common_pb2.StructuredOutput(kind=_TO_PROTO[spec.kind], value=spec.value, strict=spec.strict)


def structured_from_proto(params: common_pb2.SamplingParams) -> StructuredSpec | None:
    """The spec a SamplingParams carries; None when unset or KIND_UNSPECIFIED
    (an unknown kind number from a newer peer also reads as None)."""
    if not params.HasField("structured"):
        return None
    msg = params.structured
    kind = _FROM_PROTO.get(msg.kind)
    if kind is None:
        return None
    return StructuredSpec(kind=kind, value=msg.value, strict=msg.strict)


# Longest schema / regex / grammar / choice list, in characters (as JSON text
# for a schema or choices). 64 KiB holds any schema a person or a pydantic
# model writes (a 40-field nested model is ~5 KiB) and bounds the grammar
# compile time and memory an engine spends on one request.
MAX_STRUCTURED_CHARS = 65536
MAX_CHOICES = 1024
_REMOVED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
_UNSUPPORTED = ("structural_tag", "disable_any_whitespace", "disable_additional_properties", "whitespace_pattern",
                "guided_decoding_backend", "guided_whitespace_pattern")
_SO_KEYS = ("json", "regex", "choice", "grammar", "json_object")


def _invalid(message: str, param: str, code: str = "invalid_value") -> ApiError:
    return ApiError(ErrorKind.INVALID_REQUEST, message, param=param, code=code)


def _unsupported(message: str, param: str) -> ApiError:
    return _invalid(message, param, code="unsupported_parameter")


def structured_from_body(body: dict[str, Any]) -> StructuredSpec | None:
    """The body's one output constraint, checked; None for free text."""
    for name, key in _REMOVED.items():
        if body.get(name) is not None:
            raise _unsupported(f"{name} was removed from vLLM's API (vLLM now ignores it, unconstrained); send "
                               f'"structured_outputs": {{"{key}": ...}} or response_format instead', name)
    for name in _UNSUPPORTED:
        if body.get(name) is not None:
            raise _unsupported(f"{name} is not supported by this server", name)
    from_format = _from_response_format(body.get("response_format"))
    from_vllm = _from_structured_outputs(body.get("structured_outputs"))
    if from_format is not None and from_vllm is not None:
        raise _invalid("set only one of response_format and structured_outputs: a request takes one constraint",
                       "structured_outputs")
    spec = from_format or from_vllm
    return None if spec is None else check_structured(spec, _param(spec, from_format is not None))


def _param(spec: StructuredSpec, from_format: bool) -> str:
    if from_format:
        return "response_format.json_schema.schema" if spec.kind == "json_schema" else "response_format"
    return "structured_outputs." + ("json" if spec.kind == "json_schema" else spec.kind)


def _from_response_format(value: Any) -> StructuredSpec | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise _invalid("response_format must be an object such as {\"type\": \"json_object\"}", "response_format")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredSpec(kind="json_object")
    if kind == "json_schema":
        return _json_schema_format(value.get("json_schema"))
    if kind in ("structural_tag", "grammar", "python"):
        raise _unsupported(f"response_format type {kind!r} is not supported; use structured_outputs "
                           "(json, regex, choice or grammar)", "response_format.type")
    raise _invalid("response_format.type must be one of 'text', 'json_object', 'json_schema'",
                   "response_format.type")


def _json_schema_format(value: Any) -> StructuredSpec:
    where = "response_format.json_schema"
    if not isinstance(value, dict):
        raise _invalid(f"{where} is required for type 'json_schema': {{\"name\", \"schema\", \"strict\"}}", where)
    name = value.get("name")
    if name is not None and (not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", name)):
        raise _invalid(f"{where}.name must be 1-64 characters of a-z, A-Z, 0-9, _ and -", f"{where}.name")
    strict = value.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise _invalid(f"{where}.strict must be true or false", f"{where}.strict")
    schema = value.get("schema")
    if not isinstance(schema, dict):
        raise _invalid(f"{where}.schema is required: a JSON Schema object", f"{where}.schema")
    return StructuredSpec(kind="json_schema", value=_dump(schema, f"{where}.schema"), strict=bool(strict))


def _from_structured_outputs(value: Any) -> StructuredSpec | None:
    if value is None:
        return None
    where = "structured_outputs"
    if not isinstance(value, dict):
        raise _invalid(f"{where} must be an object with one of {list(_SO_KEYS)}", where)
    for key in value:
        if key in _UNSUPPORTED:
            raise _unsupported(f"{where}.{key} is not supported by this server", f"{where}.{key}")
        if key not in _SO_KEYS:
            raise _invalid(f"{where} takes one of {list(_SO_KEYS)}, not {str(key)[:40]!r}", f"{where}.{key}")
    present = [key for key in _SO_KEYS if value.get(key) is not None]
    if len(present) != 1:
        found = f"got {present}" if present else "got none"
        raise _invalid(f"{where} takes exactly one of {list(_SO_KEYS)}; {found}", where)
    key = present[0]
    return _so_spec(key, value[key], f"{where}.{key}")


def _so_spec(key: str, raw: Any, param: str) -> StructuredSpec:
    if key == "json":
        if isinstance(raw, str):
            raw = _loads(raw, param)
        if not isinstance(raw, dict):
            raise _invalid(f"{param} must be a JSON Schema object (or its JSON text)", param)
        return StructuredSpec(kind="json_schema", value=_dump(raw, param))
    if key == "json_object":
        if raw is not True:
            raise _invalid(f"{param} must be true when set; omit structured_outputs for free text", param)
        return StructuredSpec(kind="json_object")
    if key == "choice":
        if not isinstance(raw, list) or not raw or not all(isinstance(c, str) for c in raw):
            raise _invalid(f"{param} must be a non-empty list of strings", param)
        return StructuredSpec(kind="choice", value=_dump(raw, param))
    if not isinstance(raw, str):
        raise _invalid(f"{param} must be a string", param)
    return StructuredSpec(kind="regex" if key == "regex" else "grammar", value=raw)


def _loads(text: str, param: str) -> Any:
    _bound(text, param)
    try:
        return json.loads(text)
    except ValueError as exc:
        raise _invalid(f"{param} is not valid JSON: {exc}", param) from exc
    except RecursionError as exc:
        raise _invalid(f"{param} is nested too deeply", param) from exc


def _dump(value: Any, param: str) -> str:
    try:
        text = json.dumps(value, allow_nan=False)  # ASCII: no lone surrogate can pass
    except RecursionError as exc:
        raise _invalid(f"{param} is nested too deeply", param) from exc
    except ValueError as exc:
        raise _invalid(f"{param} must not contain NaN or Infinity", param) from exc
    return _bound(text, param)


def _bound(text: str, param: str) -> str:
    if len(text) > MAX_STRUCTURED_CHARS:
        raise _invalid(f"{param} is {len(text)} characters; at most {MAX_STRUCTURED_CHARS} are accepted", param)
    return text


def _text(text: str, param: str) -> str:
    _bound(text, param)
    if "\x00" in text:
        raise _invalid(f"{param} must not contain a NUL character", param)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise _invalid(f"{param} is not valid Unicode (a lone surrogate at character {exc.start})", param) from exc
    return text


def check_structured(spec: StructuredSpec, param: str) -> StructuredSpec:
    """`spec` if an engine can take it; else a 400 on `param` saying why."""
    if spec.kind == "json_object":
        return StructuredSpec(kind="json_object", strict=spec.strict)
    _text(spec.value, param)
    if spec.kind == "json_schema" and not _known_valid_schema(spec.value):
        _check_schema(_loads(spec.value, param), param)
    elif spec.kind == "choice":
        choices = _loads(spec.value, param)
        if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
            raise _invalid(f"{param} must be a non-empty list of strings", param)
        if len(choices) > MAX_CHOICES:
            raise _invalid(f"{param} holds {len(choices)} choices; at most {MAX_CHOICES}", param)
        for choice in choices:
            _text(choice, param)
    elif spec.kind == "regex":
        try:
            re.compile(spec.value)
        except (re.error, RecursionError, OverflowError) as exc:
            raise _invalid(f"{param} is not a valid regular expression: {exc}", param) from exc
    elif not spec.value.strip():
        raise _invalid(f"{param} must not be empty", param)
    return spec


@functools.lru_cache(maxsize=1024)
def _known_valid_schema(text: str) -> bool:
    """Whether `text` is a JSON object that is a valid draft 2020-12 schema.
    Memoised because jsonschema's own check costs 0.5-2.5 ms per schema on
    these cores -- as much as the rest of the gateway's work on a request --
    and agents send the same tools and schemas on every turn. A pure function
    of an immutable string, so the memo cannot change an answer; an invalid
    text is checked again by `_check_schema` for its message."""
    try:
        schema = json.loads(text)
        if not isinstance(schema, dict):
            return False
        Draft202012Validator.check_schema(schema)
    except (ValueError, RecursionError, SchemaError):
        return False
    return True


def _check_schema(schema: Any, param: str) -> None:
    if not isinstance(schema, dict):
        raise _invalid(f"{param} must be a JSON Schema object", param)
    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as exc:
        where = "/".join(str(p) for p in exc.path)
        at = f" at {where!r}" if where else ""
        raise _invalid(f"{param} is not a valid JSON Schema (draft 2020-12){at}: {exc.message}", param) from exc
    except RecursionError as exc:
        raise _invalid(f"{param} is nested too deeply", param) from exc
