"""Which tools a request offers the model and in which format its tool calls
are written -- decided here once, for both directions:

- into the prompt: the generic tool prompt (prompt.py) lists the offered
  tools and asks for calls in this format, and writes the history's calls
  in it;
- out of the text: the parser of the same name (parsers.py) reads them.

The format is the model's own (`models[].tool_parser`, one of the config's
TOOL_PARSERS: "hermes" or "json"), except that a request whose `tool_choice`
is "required" or a named function uses "json" whatever the model's: its
output is constrained to bare JSON calls (request.py `tool_call_schema`).
No tools are offered -- and no calls read out of the text -- without tools
or with `tool_choice` "none" (OpenAI: the model then calls no tool).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from services.common.tool_calling.request import ToolRequest, forced_tool_names

if TYPE_CHECKING:
    from services.common.openai_api.requests import GenerationInput

__all__ = ["FORCED_FORMAT", "call_format", "offered_tools"]

# The format a forced tool_choice's output is constrained to (request.py).
FORCED_FORMAT = "json"


def offered_tools(generation: GenerationInput) -> list[dict[str, Any]] | None:
    """The tools the model is offered (in its prompt) and whose calls are read
    out of its text; None: no tool calling for this request."""
    if not generation.tools or generation.tool_choice == "none":
        return None
    return generation.tools


def call_format(generation: GenerationInput, model_format: str) -> str:
    """The format of this request's tool calls, in its prompt and in its
    output: FORCED_FORMAT when `tool_choice` forces calls, else the model's
    (`model_format`, its `models[].tool_parser`)."""
    request = ToolRequest(generation.tools or [], generation.tool_choice, generation.parallel_tool_calls)
    return FORCED_FORMAT if forced_tool_names(request) else model_format
