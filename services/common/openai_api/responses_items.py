"""The Responses API's conversation items: what `input` may hold, checked and
normalized, and a list of them as chat messages.

Normalized items (what a stored response keeps, and what a continuation
replays) have exactly these shapes:

    {"type": "message", "role": R, "content": TEXT}     R: user/system/developer/assistant
    {"type": "function_call", "call_id": ID, "name": NAME, "arguments": JSON_TEXT}
    {"type": "function_call_output", "call_id": ID, "output": TEXT}

Text parts (`input_text`, `output_text`, `text`) are joined into one string;
every other part or item type is a 400 naming where it is. Pure functions.
"""

from __future__ import annotations

from typing import Any

from services.common.openai_api.errors import ApiError, ErrorKind
from services.common.openai_api.requests import invalid, show_value

__all__ = ["MESSAGE_ROLES", "items_to_messages", "normalize_input"]

MESSAGE_ROLES = ("user", "system", "developer", "assistant")
_TEXT_PARTS = frozenset({"input_text", "output_text", "text"})
# Items another OpenAI feature produces; named in the error so a client knows
# what to leave out.
_UNSUPPORTED_ITEMS = {
    "item_reference": "item references (send the item itself)",
    "reasoning": "reasoning items (this server's models return none)",
    "file_search_call": "hosted tools", "web_search_call": "hosted tools", "computer_call": "hosted tools",
    "computer_call_output": "hosted tools", "code_interpreter_call": "hosted tools",
    "image_generation_call": "hosted tools", "local_shell_call": "hosted tools", "mcp_call": "hosted tools",
    "custom_tool_call": "custom tools", "custom_tool_call_output": "custom tools",
}


def _unsupported(message: str, param: str) -> ApiError:
    return ApiError(ErrorKind.INVALID_REQUEST, message, param=param, code="unsupported_value")


def _string(item: dict[str, Any], name: str, where: str, *, empty: bool = False) -> str:
    value = item.get(name)
    if not isinstance(value, str) or (not empty and not value):
        raise invalid(f"{where}.{name} must be a {'' if empty else 'non-empty '}string, got {show_value(value)}",
                      f"{where}.{name}")
    return value


def _text(content: Any, where: str) -> str:
    """A string, or a list of text parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(f"{where} must be a string or a list of input_text parts, got {show_value(content)}", where)
    texts = []
    for j, part in enumerate(content):
        at = f"{where}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS:
            if isinstance(kind, str) and kind in ("input_image", "input_file", "input_audio", "refusal"):
                raise _unsupported(f"{at}: {kind} parts are not supported; send text (input_text)", f"{at}.type")
            raise invalid(f"{at} must be a text part {{type: input_text, text}}, got {show_value(part)}",
                          f"{at}.type")
        texts.append(_string(part, "text", at, empty=True))
    return "".join(texts)


def _message(item: dict[str, Any], where: str) -> dict[str, Any]:
    role = item.get("role")
    if not isinstance(role, str) or role not in MESSAGE_ROLES:
        raise invalid(f"{where}.role must be one of {list(MESSAGE_ROLES)}, got {show_value(role)}", f"{where}.role")
    if "content" not in item:
        raise invalid(f"{where}.content is required", f"{where}.content")
    return {"type": "message", "role": role, "content": _text(item["content"], f"{where}.content")}


def _function_call(item: dict[str, Any], where: str) -> dict[str, Any]:
    return {
        "type": "function_call",
        "call_id": _string(item, "call_id", where),
        "name": _string(item, "name", where),
        "arguments": _string(item, "arguments", where, empty=True),
    }


def _function_call_output(item: dict[str, Any], where: str) -> dict[str, Any]:
    if "output" not in item:
        raise invalid(f"{where}.output is required: the tool's result as text", f"{where}.output")
    return {
        "type": "function_call_output",
        "call_id": _string(item, "call_id", where),
        "output": _text(item["output"], f"{where}.output"),
    }


def _item(i: int, raw: Any) -> dict[str, Any]:
    where = f"input[{i}]"
    if not isinstance(raw, dict):
        raise invalid(f"{where} must be an item object (a message, function_call or function_call_output)", where)
    kind = raw.get("type", "message")
    if kind == "message":
        return _message(raw, where)
    if kind == "function_call":
        return _function_call(raw, where)
    if kind == "function_call_output":
        return _function_call_output(raw, where)
    if isinstance(kind, str) and kind in _UNSUPPORTED_ITEMS:
        raise _unsupported(f"{where}: {kind} items are not supported ({_UNSUPPORTED_ITEMS[kind]}); "
                           "send message, function_call and function_call_output items", f"{where}.type")
    raise invalid(f"{where}.type must be message, function_call or function_call_output, got {show_value(kind)}",
                  f"{where}.type")


def normalize_input(raw: Any) -> list[dict[str, Any]]:
    """`input` (a string, or a list of items) as normalized items."""
    if isinstance(raw, str):
        return [{"type": "message", "role": "user", "content": raw}]
    if not isinstance(raw, list):
        raise invalid(f"input must be a string or a list of items, got {show_value(raw)}", "input")
    return [_item(i, item) for i, item in enumerate(raw)]


def items_to_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Normalized items as chat messages: a function_call joins the assistant
    message right before it (or starts one) as a `tool_calls` entry; a
    function_call_output is a `role: tool` message."""
    messages: list[dict[str, Any]] = []
    for item in items:
        kind = item["type"]
        if kind == "message":
            messages.append({"role": item["role"], "content": item["content"]})
        elif kind == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
    return messages
