"""A `POST /v1/responses` body -> a `ResponsesRequest`, or an `ApiError`
(400) naming the Responses parameter to change.

The Responses API is served ON the chat path: `chat_body` turns the request
(plus the items of the response it continues) into a Chat Completions body --
messages, tools in chat's nested shape, tool_choice, parallel_tool_calls,
`text.format` as `response_format`, max_output_tokens as
max_completion_tokens -- which `parse_chat_body` parses like any chat
request; an error it raises is renamed back to the Responses parameter
(`responses_param`).

Every top-level field is known here: accepted and used, accepted and ignored
(`_IGNORED`, harmless for a server that has no hosted tools, no reasoning
models and caches every prefix on its own -- README "Responses API"), or
refused by name. Pure functions, no I/O.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from services.common.openai_api.errors import ApiError, ErrorKind
from services.common.openai_api.requests import invalid, show_value
from services.common.openai_api.responses_items import items_to_messages, normalize_input

__all__ = ["ResponsesRequest", "chat_body", "parse_responses_body", "responses_param"]

# Used: turned into the chat body or the response's own settings.
_USED = frozenset({
    "model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "tools", "tool_choice",
    "parallel_tool_calls", "text", "metadata", "store", "previous_response_id", "stream",
})
# Sampling extensions vLLM's server also takes on /v1/responses, passed to the chat parser as they are.
_PASSED = frozenset({"top_k", "min_p", "seed", "presence_penalty", "frequency_penalty", "repetition_penalty"})
# Accepted and ignored: what the official SDKs and openai-agents send that
# changes nothing here (include=[] on every agents call; truncation: this
# server never drops items, an overflow is a 400; prompt_cache_*: every
# prefix is cached anyway; reasoning: the models do not reason separately).
_IGNORED = frozenset({
    "include", "truncation", "user", "safety_identifier", "prompt_cache_key", "prompt_cache_retention",
    "service_tier", "reasoning", "stream_options",
})
# Refused with a reason.
_REFUSED = {
    "background": "background responses are not supported; use stream",
    "conversation": "the Conversations API is not served; use previous_response_id with store: true",
    "prompt": "stored prompt templates are not served; send instructions and input",
    "top_logprobs": "logprobs are not served on /v1/responses; use /v1/chat/completions",
    "max_tool_calls": "max_tool_calls is not supported",
    "context_management": "context_management is not supported",
    "messages": "/v1/responses takes input (a string or a list of items), not messages",
    "max_tokens": "/v1/responses takes max_output_tokens",
    "response_format": "/v1/responses takes text: {format: ...}",
    "n": "n is not supported on /v1/responses; use /v1/chat/completions",
}
_TRUTHY_REFUSALS = frozenset({"background"})  # refused only when set to a true value
_METADATA_KEYS, _METADATA_KEY_LEN, _METADATA_VALUE_LEN = 16, 64, 512


@dataclass
class ResponsesRequest:
    model: str
    items: list[dict[str, Any]]            # this request's input, normalized
    instructions: str | None
    previous_response_id: str | None
    store: bool
    stream: bool
    metadata: dict[str, str]
    chat: dict[str, Any]                   # the chat body, without messages
    settings: dict[str, Any] = field(default_factory=dict)  # echoed in the Response object


def _unknown(name: str) -> ApiError:
    return ApiError(ErrorKind.INVALID_REQUEST, f"unknown parameter {show_value(name)} for /v1/responses",
                    param=name, code="unknown_parameter")


def _check_fields(body: dict[str, Any]) -> None:
    for name, value in body.items():
        if name in _USED or name in _PASSED or name in _IGNORED:
            continue
        if name in _REFUSED:
            if name in _TRUTHY_REFUSALS and not value:
                continue
            raise ApiError(ErrorKind.INVALID_REQUEST, _REFUSED[name], param=name, code="unsupported_parameter")
        raise _unknown(name)


def _optional_str(body: dict[str, Any], name: str) -> str | None:
    value = body.get(name)
    if value is not None and not isinstance(value, str):
        raise invalid(f"{name} must be a string, got {show_value(value)}", name)
    return value


def _flag(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise invalid(f"{name} must be true or false, got {show_value(value)}", name)
    return value


def _metadata(body: dict[str, Any]) -> dict[str, str]:
    value = body.get("metadata")
    if value is None:
        return {}
    if not isinstance(value, dict) or len(value) > _METADATA_KEYS:
        raise invalid(f"metadata must be an object of at most {_METADATA_KEYS} string pairs", "metadata")
    for key, item in value.items():
        if len(key) > _METADATA_KEY_LEN or not isinstance(item, str) or len(item) > _METADATA_VALUE_LEN:
            raise invalid(f"metadata[{show_value(key)}]: keys up to {_METADATA_KEY_LEN} characters, values "
                          f"strings up to {_METADATA_VALUE_LEN}", "metadata")
    return dict(value)


def _tool(i: int, raw: Any) -> dict[str, Any]:
    where = f"tools[{i}]"
    if not isinstance(raw, dict):
        raise invalid(f"{where} must be a tool object {{type: function, name, parameters}}", where)
    kind = raw.get("type")
    if kind != "function":
        raise ApiError(ErrorKind.INVALID_REQUEST, f"{where}.type: only function tools are supported, got "
                       f"{show_value(kind)} (hosted tools such as web_search run at OpenAI only)",
                       param=f"{where}.type", code="unsupported_value")
    name = raw.get("name")
    if not isinstance(name, str) or not name:
        raise invalid(f"{where}.name must be a non-empty string", f"{where}.name")
    function: dict[str, Any] = {"name": name}
    for key in ("description", "parameters", "strict"):
        if raw.get(key) is not None:
            function[key] = raw[key]
    return {"type": "function", "function": function}


def _tools(body: dict[str, Any]) -> list[dict[str, Any]]:
    raw = body.get("tools")
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise invalid("tools must be a list of function tools", "tools")
    return [_tool(i, tool) for i, tool in enumerate(raw)]


def _tool_choice(body: dict[str, Any], tools: list[dict[str, Any]]) -> Any:
    choice = body.get("tool_choice")
    if choice is None or choice in ("none", "auto", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        name = choice.get("name")
        if not isinstance(name, str) or name not in {t["function"]["name"] for t in tools}:
            raise invalid(f"tool_choice names function {show_value(name)}, which is not in tools",
                          "tool_choice.name")
        return {"type": "function", "function": {"name": name}}
    raise invalid("tool_choice must be none, auto, required or {type: function, name}, got "
                  f"{show_value(choice)}", "tool_choice")


def _response_format(body: dict[str, Any]) -> dict[str, Any] | None:
    """`text.format` in chat's `response_format` shape (None = plain text)."""
    text = body.get("text")
    if text is None:
        return None
    if not isinstance(text, dict) or not set(text) <= {"format", "verbosity"}:
        raise invalid("text must be an object {format: {type: ...}}", "text")
    if text.get("format") is None:
        return None
    fmt = text["format"] if isinstance(text["format"], dict) else {}
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if fmt.get(k) is not None}
        return {"type": "json_schema", "json_schema": schema}
    raise invalid(f"text.format.type must be text, json_object or json_schema, got {show_value(kind)}",
                  "text.format.type")


def _chat_fields(body: dict[str, Any]) -> dict[str, Any]:
    """Everything of the chat body but messages."""
    chat: dict[str, Any] = {name: body[name] for name in ("model", "temperature", "top_p", *_PASSED) if name in body}
    if body.get("max_output_tokens") is not None:
        chat["max_completion_tokens"] = body["max_output_tokens"]
    tools = _tools(body)
    if tools:
        chat["tools"] = tools
        choice = _tool_choice(body, tools)
        if choice is not None:
            chat["tool_choice"] = choice
        chat["parallel_tool_calls"] = _flag(body, "parallel_tool_calls", True)
    elif body.get("tool_choice") not in (None, "none", "auto"):
        raise invalid("tool_choice needs tools", "tool_choice")
    response_format = _response_format(body)
    if response_format is not None:
        chat["response_format"] = response_format
    return chat


def parse_responses_body(body: Any) -> ResponsesRequest:
    if not isinstance(body, dict):
        raise ApiError(ErrorKind.INVALID_REQUEST, "the request body must be a JSON object")
    _check_fields(body)
    if "input" not in body:
        raise ApiError(ErrorKind.INVALID_REQUEST, "input is required: a string or a list of items",
                       param="input", code="missing_required_parameter")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError(ErrorKind.INVALID_REQUEST, "model is required: name one from GET /v1/models",
                       param="model", code="missing_required_parameter")
    previous = _optional_str(body, "previous_response_id")
    if previous is not None and not previous:
        raise invalid("previous_response_id must not be empty", "previous_response_id")
    chat = _chat_fields(body)
    return ResponsesRequest(
        model=model,
        items=normalize_input(body["input"]),
        instructions=_optional_str(body, "instructions"),
        previous_response_id=previous,
        store=_flag(body, "store", False),
        stream=_flag(body, "stream", False),
        metadata=_metadata(body),
        chat=chat,
        settings=_settings(body),
    )


def _settings(body: dict[str, Any]) -> dict[str, Any]:
    """The request's settings as the Response object echoes them."""
    text = body.get("text") if isinstance(body.get("text"), dict) else None
    return {
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "temperature": body.get("temperature", 1.0),
        "top_p": body.get("top_p", 1.0),
        "tools": body.get("tools") or [],
        "tool_choice": body.get("tool_choice") or "auto",
        "parallel_tool_calls": _flag(body, "parallel_tool_calls", True),
        "text": {"format": (text or {}).get("format") or {"type": "text"}},
        "truncation": body.get("truncation") or "disabled",
    }


def chat_body(request: ResponsesRequest, history: list[dict[str, Any]]) -> dict[str, Any]:
    """The Chat Completions body this request runs as: `history` (the items
    of the response it continues, outputs included) then its own input,
    after its instructions as a system message."""
    messages = items_to_messages([*history, *request.items])
    if request.instructions:
        messages.insert(0, {"role": "system", "content": request.instructions})
    if not messages:
        raise invalid("input is empty: send at least one message", "input")
    return {**request.chat, "messages": messages, "stream": request.stream}


_MESSAGES_PARAM = re.compile(r"^messages(\[\d+\])?")
_TOOL_PARAM = re.compile(r"^tools\[(\d+)\]\.function\.")


def responses_param(param: str | None) -> str | None:
    """A chat body's parameter name as the Responses request spells it."""
    if param is None:
        return None
    if param in ("max_completion_tokens", "max_tokens"):
        return "max_output_tokens"
    if param.startswith("response_format"):
        return "text.format" + param[len("response_format"):].replace(".json_schema", "")
    if _MESSAGES_PARAM.match(param):
        return "input"
    return _TOOL_PARAM.sub(r"tools[\1].", param)
