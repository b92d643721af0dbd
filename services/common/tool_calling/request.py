"""Tool calling in OpenAI request bodies: `tools`, `tool_choice`,
`parallel_tool_calls`, and the tool fields of history messages (assistant
`tool_calls`, `role: tool` with `tool_call_id`) -> normalized values, or a
400 naming the parameter (`tools[1].function.name`).

Normalized shapes (what `GenerationInput` carries and the chat template sees):
- a tool: `{"type": "function", "function": {"name", "description",
  "parameters", "strict"}}` (description "" and parameters `{"type":
  "object", "properties": {}}` when absent);
- `tool_choice`: "none" | "auto" | "required" | `{"type": "function",
  "function": {"name": ...}}` (a named function);
- an assistant history message may carry `tool_calls`: `[{"id", "type":
  "function", "function": {"name", "arguments"}}]` (arguments the JSON text
  the client sent); a tool message `tool_call_id`.

`required` and a named function are enforced with structured outputs:
`tool_call_schema` is the JSON schema the output must match (a call is
`{"name": <one of the allowed names>, "arguments": <its parameters schema>}`;
with `parallel_tool_calls` a `required` choice is a non-empty array of calls,
otherwise exactly one call); the gateway maps the bare JSON back to
tool calls (parsers.py, parser "json"; call_format.py picks it).

Pure functions, no I/O. The Responses API's flat tool and tool-choice shapes
(`{"type": "function", "name": ...}`) parse with `flat=True`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from services.common.openai_api.errors import ApiError, ErrorKind
from services.common.openai_api.structured_outputs import StructuredSpec, check_structured

if TYPE_CHECKING:
    from services.common.openai_api.requests import GenerationInput

__all__ = [
    "MAX_TOOLS",
    "TOOL_CHOICES",
    "ToolRequest",
    "apply_tool_request",
    "forced_tool_names",
    "parse_message_tool_fields",
    "parse_tool_choice",
    "parse_tool_request",
    "parse_tools",
    "set_tool_request",
    "tool_call_schema",
]

MAX_TOOLS = 128  # OpenAI's limit on `tools`
TOOL_CHOICES = ("none", "auto", "required")

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
_EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


def _invalid(message: str, param: str) -> ApiError:
    return ApiError(ErrorKind.INVALID_REQUEST, message, param=param, code="invalid_value")


def _short(value: Any) -> str:
    text = json.dumps(value, default=str) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


@dataclass
class ToolRequest:
    """The tool fields of one request, normalized (module docstring)."""

    tools: list[dict[str, Any]] = field(default_factory=list)
    tool_choice: str | dict[str, Any] = "none"
    parallel_tool_calls: bool = True


# ------------------------------------------------------------ tools


def _check_schema(schema: Any, param: str) -> None:
    """A tool's parameters: a JSON schema of an object (OpenAI's rule),
    valid under draft 2020-12 and within the structured-output bounds."""
    if not isinstance(schema, dict):
        raise _invalid(f"{param} must be a JSON schema object, got {_short(schema)}", param)
    kind = schema.get("type", "object")
    if kind != "object":
        raise _invalid(f"{param} must be a JSON schema of type \"object\", got type {_short(kind)}", param)
    try:
        text = json.dumps(schema)
    except (ValueError, RecursionError):
        raise _invalid(f"{param} is nested too deeply", param) from None
    check_structured(StructuredSpec("json_schema", text), param)


def _text(raw: dict[str, Any], key: str, param: str) -> str:
    value = raw.get(key)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise _invalid(f"{param}.{key} must be a string, got {_short(value)}", f"{param}.{key}")
    return value


def _function(raw: Any, where: str) -> dict[str, Any]:
    """One function definition (`tools[i].function`, or the flat tool itself)."""
    if not isinstance(raw, dict):
        raise _invalid(f"{where} must be an object with name and parameters", where)
    name = raw.get("name")
    if name is None:
        raise ApiError(ErrorKind.INVALID_REQUEST, f"{where}.name is required", param=f"{where}.name",
                       code="missing_required_parameter")
    if not isinstance(name, str) or not _NAME.match(name):
        raise _invalid(f"{where}.name must be 1-64 letters, digits, '_' or '-', got {_short(name)}", f"{where}.name")
    parameters = raw.get("parameters")
    if parameters is None:
        parameters = dict(_EMPTY_PARAMETERS)
    _check_schema(parameters, f"{where}.parameters")
    strict = raw.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise _invalid(f"{where}.strict must be true or false, got {_short(strict)}", f"{where}.strict")
    return {"name": name, "description": _text(raw, "description", where), "parameters": parameters,
            "strict": bool(strict)}


def _tool(i: int, raw: Any, param: str, flat: bool) -> dict[str, Any]:
    where = f"{param}[{i}]"
    if not isinstance(raw, dict):
        raise _invalid(f"{where} must be an object {{type: \"function\", function: {{...}}}}", where)
    kind = raw.get("type")
    if kind != "function":
        raise _invalid(f"{where}.type must be \"function\" (the only tool type served), got {_short(kind)}",
                       f"{where}.type")
    if flat:
        return {"type": "function", "function": _function(raw, where)}
    if raw.get("function") is None:
        raise ApiError(ErrorKind.INVALID_REQUEST, f"{where}.function is required", param=f"{where}.function",
                       code="missing_required_parameter")
    return {"type": "function", "function": _function(raw["function"], f"{where}.function")}


def parse_tools(value: Any, param: str = "tools", *, flat: bool = False) -> list[dict[str, Any]]:
    """`tools` -> normalized tools ([] when absent or empty)."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise _invalid(f"{param} must be a list of function tools", param)
    if len(value) > MAX_TOOLS:
        raise _invalid(f"{param} may hold at most {MAX_TOOLS} tools, got {len(value)}", param)
    tools = [_tool(i, raw, param, flat) for i, raw in enumerate(value)]
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        name = tool["function"]["name"]
        if name in seen:
            where = f"{param}[{i}]" + ("" if flat else ".function")
            raise _invalid(f"{where}.name: the function name {name!r} is defined twice", f"{where}.name")
        seen.add(name)
    return tools


# ------------------------------------------------------------ tool_choice


def parse_tool_choice(
    value: Any, tools: Sequence[dict[str, Any]], param: str = "tool_choice", *, flat: bool = False
) -> str | dict[str, Any]:
    """`tool_choice` -> "none" | "auto" | "required" | a named function.
    Absent: "auto" with tools, "none" without (OpenAI's defaults)."""
    if value is None:
        return "auto" if tools else "none"
    if isinstance(value, str):
        if value not in TOOL_CHOICES:
            raise _invalid(f"{param} must be one of {list(TOOL_CHOICES)} or {{type: \"function\", function: "
                           f"{{name}}}}, got {_short(value)}", param)
        if value == "required" and not tools:
            raise _invalid(f"{param} \"required\" needs tools: send the functions the model may call", param)
        return value
    if not isinstance(value, dict) or value.get("type") != "function":
        raise _invalid(f"{param} must be a string or {{type: \"function\", function: {{name}}}}, got {_short(value)}",
                       param)
    where = param
    if not flat:
        value, where = value.get("function"), f"{param}.function"
        if not isinstance(value, dict):
            raise _invalid(f"{where} must be an object {{name}}", where)
    name = value.get("name")
    if not isinstance(name, str) or not name:
        raise _invalid(f"{where}.name must name one of the tools", f"{where}.name")
    if name not in {t["function"]["name"] for t in tools}:
        known = ", ".join(t["function"]["name"] for t in tools) or "none"
        raise _invalid(f"{where}.name {name!r} is not among the tools (defined: {known})", f"{where}.name")
    return {"type": "function", "function": {"name": name}}


def _parallel(body: dict[str, Any]) -> bool:
    value = body.get("parallel_tool_calls")
    if value is None:
        return True
    if not isinstance(value, bool):
        raise _invalid(f"parallel_tool_calls must be true or false, got {_short(value)}", "parallel_tool_calls")
    return value


def parse_tool_request(body: dict[str, Any]) -> ToolRequest:
    """The chat body's tool fields. The legacy `functions` / `function_call`
    are refused by name (send `tools`)."""
    for legacy in ("functions", "function_call"):
        if body.get(legacy) is not None:
            raise ApiError(ErrorKind.INVALID_REQUEST, f"{legacy} is deprecated and not served; send tools and "
                           "tool_choice", param=legacy, code="unsupported_parameter")
    tools = parse_tools(body.get("tools"))
    return ToolRequest(tools, parse_tool_choice(body.get("tool_choice"), tools), _parallel(body))


# ------------------------------------------------------------ history messages


def _tool_call(where: str, raw: Any) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise _invalid(f"{where} must be an object {{id, type: \"function\", function: {{name, arguments}}}}", where)
    call_id = raw.get("id")
    if not isinstance(call_id, str) or not call_id:
        raise _invalid(f"{where}.id must be the call's id (a non-empty string)", f"{where}.id")
    if raw.get("type", "function") != "function":
        raise _invalid(f"{where}.type must be \"function\", got {_short(raw.get('type'))}", f"{where}.type")
    function = raw.get("function")
    if not isinstance(function, dict):
        raise _invalid(f"{where}.function must be an object {{name, arguments}}", f"{where}.function")
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise _invalid(f"{where}.function.name must be a non-empty string", f"{where}.function.name")
    arguments = function.get("arguments", "")
    if not isinstance(arguments, str):
        raise _invalid(f"{where}.function.arguments must be a string of JSON, got {_short(arguments)}",
                       f"{where}.function.arguments")
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def parse_message_tool_fields(where: str, raw: dict[str, Any], message: dict[str, Any]) -> None:
    """Adds the tool fields of history message `raw` (at `where`, e.g.
    `messages[2]`) to its parsed `message`."""
    role = message["role"]
    calls = raw.get("tool_calls")
    if calls is not None:
        if role != "assistant":
            raise _invalid(f"{where}.tool_calls is only allowed on assistant messages", f"{where}.tool_calls")
        if not isinstance(calls, list):
            raise _invalid(f"{where}.tool_calls must be a list of calls", f"{where}.tool_calls")
        if calls:
            message["tool_calls"] = [_tool_call(f"{where}.tool_calls[{j}]", c) for j, c in enumerate(calls)]
    call_id = raw.get("tool_call_id")
    if role == "tool":
        if not isinstance(call_id, str) or not call_id:
            raise _invalid(f"{where}.tool_call_id is required on a tool message: the id of the call it answers",
                           f"{where}.tool_call_id")
        message["tool_call_id"] = call_id
    elif call_id is not None:
        raise _invalid(f"{where}.tool_call_id is only allowed on tool messages", f"{where}.tool_call_id")


# ------------------------------------------------------------ enforcement


def forced_tool_names(request: ToolRequest) -> list[str]:
    """The functions the output MUST call (empty: the model decides)."""
    choice = request.tool_choice
    if isinstance(choice, dict):
        return [choice["function"]["name"]]
    if choice == "required":
        return [t["function"]["name"] for t in request.tools]
    return []


def _call_schema(tool: dict[str, Any]) -> dict[str, Any]:
    function = tool["function"]
    return {
        "type": "object",
        "properties": {"name": {"type": "string", "enum": [function["name"]]}, "arguments": function["parameters"]},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def tool_call_schema(request: ToolRequest) -> dict[str, Any] | None:
    """The JSON schema a forced choice constrains the output to (module
    docstring), or None when the model decides."""
    names = forced_tool_names(request)
    if not names:
        return None
    calls = [_call_schema(t) for t in request.tools if t["function"]["name"] in names]
    one = calls[0] if len(calls) == 1 else {"anyOf": calls}
    if request.tool_choice == "required" and request.parallel_tool_calls:
        return {"type": "array", "items": one, "minItems": 1}
    return one


def set_tool_request(generation: GenerationInput, request: ToolRequest, param: str = "tool_choice") -> None:
    """Puts `request` on `generation`; a forced choice also sets the output
    constraint (`generation.structured`), which must not be set already."""
    generation.tools = request.tools or None
    generation.tool_choice = request.tool_choice
    generation.parallel_tool_calls = request.parallel_tool_calls
    schema = tool_call_schema(request)
    if schema is None:
        return
    if generation.structured is not None:
        raise _invalid(f"{param} {_short(request.tool_choice)} constrains the output to tool calls; it cannot be "
                       "combined with response_format or another output constraint", param)
    spec = StructuredSpec("json_schema", json.dumps(schema, separators=(",", ":")), strict=True)
    generation.structured = check_structured(spec, "tools")


def apply_tool_request(generation: GenerationInput, body: dict[str, Any]) -> None:
    """The chat body's tool fields, parsed and put on `generation`."""
    set_tool_request(generation, parse_tool_request(body))

