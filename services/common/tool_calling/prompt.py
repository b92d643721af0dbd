"""Tools in the prompt, for a chat template that does not render them.

A template that takes `tools` (it names the variable, like Qwen2.5's or
Llama 3.1's) gets the tools and the history's tool calls and results as
Hugging Face defines them (`template_messages`: each call's `arguments`
as a dict, as vLLM passes them). Any other template -- SmolLM2's, say, which
knows only role and content -- gets the generic tool prompt instead
(`generic_messages`), plain messages it can render:

- the tools, in a system message (appended to the first system message, or a
  new one at the start), in the format vLLM's "hermes" parser reads (the
  prompt Qwen2.5 and NousResearch's Hermes models were trained on):

      # Tools

      You may call one or more functions to assist with the user query.

      You are provided with function signatures within <tools></tools> XML tags:
      <tools>
      {"type": "function", "function": {"name": ..., "description": ..., "parameters": {...}}}
      </tools>

      For each function call, return a json object with function name and arguments within
      <tool_call></tool_call> XML tags:
      <tool_call>
      {"name": <function-name>, "arguments": <args-json-object>}
      </tool_call>

  With the "json" format (`models[].tool_parser: json`) the last paragraph
  asks for the bare JSON object (or a JSON array of them) instead.
- an assistant turn with `tool_calls`: its content, then each call as the
  model would have written it (`<tool_call>\\n{"name": ..., "arguments":
  ...}\\n</tool_call>`, or the bare JSON);
- tool results: a user turn of `<tool_response>\\n<content>\\n</tool_response>`
  blocks, consecutive results in one turn (templates that insist on
  alternating user/assistant turns accept it).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from services.common.config import TOOL_PARSERS

__all__ = ["generic_messages", "has_tool_fields", "template_messages"]

_HEAD = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
_HERMES_FORMAT = (
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)
_JSON_FORMAT = (
    "To call a function, answer with only a json object with function name and arguments, "
    '{"name": <function-name>, "arguments": <args-json-object>}, or a json array of such '
    "objects to call several."
)
# Per call format (call_format.py decides which; parsers.py reads each): how
# the prompt asks for calls, and what wraps one call's JSON when the
# history's calls are written back.
_ASK: dict[str, str] = {"hermes": _HERMES_FORMAT, "json": _JSON_FORMAT}
_WRAP: dict[str, tuple[str, str]] = {"hermes": ("<tool_call>\n", "\n</tool_call>"), "json": ("", "")}
if tuple(_ASK) != TOOL_PARSERS or tuple(_WRAP) != TOOL_PARSERS:  # pragma: no cover - kept in step with config
    raise RuntimeError(f"tool prompt formats {tuple(_ASK)} differ from the config's {TOOL_PARSERS}")


def has_tool_fields(messages: Sequence[dict[str, Any]]) -> bool:
    return any(m.get("tool_calls") or m.get("role") == "tool" for m in messages)


def _arguments(text: str) -> Any:
    """A call's arguments as an object when they are JSON text, else the text."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def template_messages(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages for a template that renders tools: arguments as dicts."""
    out = []
    for message in messages:
        if message.get("tool_calls"):
            calls = [{**c, "function": {**c["function"], "arguments": _arguments(c["function"]["arguments"])}}
                     for c in message["tool_calls"]]
            out.append({**message, "tool_calls": calls})
        else:
            out.append(message)
    return out


def _tools_block(tools: Sequence[dict[str, Any]], fmt: str) -> str:
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return f"{_HEAD}\n{listed}\n</tools>\n\n{_ASK[fmt]}"


def _call_text(call: dict[str, Any], fmt: str) -> str:
    function = call["function"]
    body = json.dumps({"name": function["name"], "arguments": _arguments(function["arguments"])},
                      ensure_ascii=False)
    before, after = _WRAP[fmt]
    return f"{before}{body}{after}"


def _assistant(message: dict[str, Any], fmt: str) -> dict[str, Any]:
    parts = [message["content"]] if message.get("content") else []
    parts += [_call_text(c, fmt) for c in message["tool_calls"]]
    plain = {k: v for k, v in message.items() if k != "tool_calls"}
    return {**plain, "content": "\n".join(parts)}


def generic_messages(
    messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None, fmt: str = "hermes"
) -> list[dict[str, Any]]:
    """Plain role/content messages carrying the tools and the history's tool
    calls and results (module docstring). `fmt`: "hermes" or "json"."""
    out: list[dict[str, Any]] = []
    for message in messages:
        if message.get("role") == "tool":
            block = f"<tool_response>\n{message.get('content') or ''}\n</tool_response>"
            if out and out[-1].get("_tool_results"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool_results": True})
        elif message.get("tool_calls"):
            out.append(_assistant(message, fmt))
        else:
            out.append(dict(message))
    for message in out:
        message.pop("_tool_results", None)
    if tools:
        block = _tools_block(tools, fmt)
        if out and out[0].get("role") == "system":
            first = out[0]
            out[0] = {**first, "content": f"{first['content']}\n\n{block}" if first.get("content") else block}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out
