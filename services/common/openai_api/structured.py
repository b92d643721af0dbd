"""Structured outputs: the one constraint a request may put on its text.

`StructuredSpec` is what every layer carries: parsed from an OpenAI body
(`response_format`, vLLM's `structured_outputs` and its older `guided_*`
fields: services/common/openai_api/structured_outputs.py), from the native
gRPC API's `SamplingParams.structured`, or set by the gateway itself (tool
calling with `tool_choice` required / a named function); sent to the engine
in `SamplingParams.structured` (common.proto `StructuredOutput`), and
enforced there (vLLM: StructuredOutputsParams, xgrammar; the simulator: a
documented minimal contract, services/engine/sim/structured.py).

The proto mapping lives here, one function each way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from services.common.proto.kvmesh.v1 import common_pb2

__all__ = ["STRUCTURED_KINDS", "StructuredKind", "StructuredSpec", "structured_from_proto", "structured_to_proto"]

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
