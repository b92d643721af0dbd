"""Tool calling on the native gRPC API (kvmesh.v1.Inference.Chat).

In: `ChatRequest.tools` / `tool_choice` / `parallel_tool_calls` and the
messages' `tool_calls` / `tool_call_id` go through the same checks as the
HTTP bodies (request.py), with the proto's field
names in errors (`tools[1].name`, `tools[0].parameters_json`).

Out: `ToolEventMapper` turns the generation's events into GenerateEvents
with the request's tool-call parser (parsers.py): each
engine delta is first a `delta` event (its token ids, logprobs, resume index
and the content text it released -- maybe ""), then `tool_call` events
(ToolCallDelta: a call's first piece has id and name, the next ones its
arguments fragments); `finished` says FINISH_REASON_TOOL_CALLS when the
model stopped after calling. Like HTTP, a tool-calling stream cannot be
resumed (`resume` is refused with tools).
"""

from __future__ import annotations

import json
from typing import Any

from services.common.openai_api.requests import invalid
from services.common.proto.kvmesh.v1 import common_pb2, inference_pb2
from services.common.tool_calling.parsers import CallArguments, CallStart, TextOut, ToolCallParser, ToolEvent
from services.common.tool_calling.request import ToolRequest, parse_tool_choice, parse_tools

__all__ = ["ToolEventMapper", "message_from_proto", "tool_request_from_proto"]


def message_from_proto(message: inference_pb2.ChatMessage) -> dict[str, Any]:
    """A ChatMessage as the OpenAI body's message dict (then parse_message)."""
    raw: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.tool_calls:
        raw["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                             for c in message.tool_calls]
    if message.tool_call_id:
        raw["tool_call_id"] = message.tool_call_id
    return raw


def _parameters(i: int, tool: inference_pb2.Tool) -> Any:
    if not tool.parameters_json:
        return None
    try:
        return json.loads(tool.parameters_json)
    except ValueError as exc:
        raise invalid(f"tools[{i}].parameters_json is not valid JSON: {exc}", f"tools[{i}].parameters_json") from exc


def tool_request_from_proto(request: inference_pb2.ChatRequest) -> ToolRequest:
    tools = parse_tools([
        {"type": "function", "name": t.name, "description": t.description, "parameters": _parameters(i, t),
         "strict": t.strict}
        for i, t in enumerate(request.tools)
    ], flat=True)
    choice: Any = None
    which = request.tool_choice.WhichOneof("choice") if request.HasField("tool_choice") else None
    if which == "mode":
        choice = request.tool_choice.mode
    elif which == "function":
        choice = {"type": "function", "name": request.tool_choice.function}
    parallel = request.parallel_tool_calls if request.HasField("parallel_tool_calls") else True
    return ToolRequest(tools, parse_tool_choice(choice, tools, flat=True), parallel)


class ToolEventMapper:
    """One tool-calling stream's events -> GenerateEvents (module docstring)."""

    def __init__(self, request_id: str, parser: ToolCallParser) -> None:
        self._request_id = request_id
        self._parser = parser

    def _call(self, event: ToolEvent) -> inference_pb2.GenerateEvent:
        if isinstance(event, CallStart):
            delta = inference_pb2.ToolCallDelta(index=event.index, id=event.call_id, name=event.name)
        elif isinstance(event, CallArguments):
            delta = inference_pb2.ToolCallDelta(index=event.index, arguments=event.fragment)
        else:  # pragma: no cover - text is not a call
            raise TypeError(event)
        return inference_pb2.GenerateEvent(request_id=self._request_id, tool_call=delta)

    def _events(self, parsed: list[ToolEvent], first: inference_pb2.GenerateEvent) -> list[inference_pb2.GenerateEvent]:
        out = [first]
        for event in parsed:
            if isinstance(event, TextOut):
                if out[-1].HasField("delta"):
                    out[-1].delta.text += event.text
                else:
                    out.append(inference_pb2.GenerateEvent(request_id=self._request_id,
                                                           delta=inference_pb2.DeltaEvent(text=event.text)))
            else:
                out.append(self._call(event))
        head = out[0]
        if not head.delta.text and not head.delta.token_ids and not head.delta.logprobs and not head.index:
            out.pop(0)
        return out

    def map(self, event: object, plain: inference_pb2.GenerateEvent) -> list[inference_pb2.GenerateEvent]:
        """The GenerateEvents for the gateway's `event`, whose tool-less form
        is `plain`. Only `plain` is read -- it carries the delta's text and
        the finish reason -- so this module needs none of the gateway's
        types."""
        which = plain.WhichOneof("event")
        if which == "delta":
            text, plain.delta.text = plain.delta.text, ""
            return self._events(self._parser.feed(text), plain)
        if which == "finished":
            held = self._events(self._parser.finish(), inference_pb2.GenerateEvent(request_id=self._request_id))
            if plain.finished.finish_reason == common_pb2.FINISH_REASON_STOP and self._parser.calls > 0:
                plain.finished.finish_reason = common_pb2.FINISH_REASON_TOOL_CALLS
            return [*held, plain]
        return [plain]
