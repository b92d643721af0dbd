"""Tool calls in the OpenAI HTTP responses: a chat formatter that runs the
request's tool-call parser (parsers.py) over the text.

Streamed, each engine delta becomes the chunks its parser events give --
content deltas, and tool-call deltas exactly as OpenAI shapes them (a call's
first chunk `{"index", "id": "call_...", "type": "function", "function":
{"name", "arguments": ""}}`, then `{"index", "function": {"arguments":
<fragment>}}`); what the parser held back goes out before the final chunk,
whose finish_reason is "tool_calls" when the model stopped after calling.
Not streamed, the message has `tool_calls` and content None (or the text
around the calls).

Limits: a delta's logprobs go out with its content chunk (none when the
delta was all tool call); chunks carry no SSE `id:`, so a tool-calling
stream cannot be resumed with Last-Event-ID (its parser state would be lost)
-- a client re-sends the request instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from services.common.openai_api.completions_output import ChatFormatter, Logprobs, UsageCounts, sse
from services.common.tool_calling.parsers import CallStart, TextOut, ToolCallParser, ToolEvent, collect

__all__ = ["ToolChatFormatter", "tool_finish_reason"]


def tool_finish_reason(reason: str, called: bool) -> str:
    """OpenAI's finish_reason: "tool_calls" when the model stopped after calling."""
    return "tool_calls" if called and reason == "stop" else reason


class ToolChatFormatter(ChatFormatter):
    resumable = False

    def __init__(self, request_id: str, model: str, include_usage: bool, parser: ToolCallParser) -> None:
        super().__init__(request_id, model, include_usage)
        self._parser = parser

    def _frames(self, events: Sequence[ToolEvent], logprobs: Logprobs) -> bytes:
        out = []
        for event in events:
            if isinstance(event, TextOut):
                out.append(sse(self.delta_chunk(event.text, logprobs)))
                logprobs = ()
            elif isinstance(event, CallStart):
                out.append(sse(self.tool_call_chunk(event.index, "", event.call_id, event.name)))
            else:
                out.append(sse(self.tool_call_chunk(event.index, event.fragment)))
        return b"".join(out)

    # One parser, one choice: tools with n > 1 are refused (http_api.py).
    def delta_sse(self, text: str, logprobs: Logprobs = (), token_ids: Sequence[int] = (), index: int = 0) -> bytes:
        return self._frames(self._parser.feed(text), logprobs)

    def final_sse(self, reason: str, index: int = 0) -> bytes:
        held = self._frames(self._parser.finish(), ())
        return held + sse(self.final_chunk(tool_finish_reason(reason, self._parser.calls > 0)))

    def response(self, text: str, logprobs: Logprobs, reason: str | None, usage: UsageCounts,
                 token_ids: Sequence[int] = ()) -> dict[str, Any]:
        content, calls = collect(self._parser, text)
        final = tool_finish_reason(reason, bool(calls)) if reason is not None else None
        return self.tool_response(content, calls, logprobs, final, usage)
