"""The Responses API's shapes: the `response` object and its typed stream
events, named and laid out as OpenAI's (and its SDK's `ResponseStreamEvent`
union parses them).

A `ResponseBuilder` is one response's state. It is fed what the generation
produced -- text, and the tool calls the gateway's parser found in it -- and
returns the events each step adds, every one with its `sequence_number`:

    response.created, response.in_progress                      (start)
    response.output_item.added (message), response.content_part.added,
        response.output_text.delta ...                          (text)
    response.output_text.done, response.content_part.done,
        response.output_item.done                               (a message ends)
    response.output_item.added (function_call),
        response.function_call_arguments.delta ...              (a tool call)
    response.function_call_arguments.done, response.output_item.done
    response.completed | response.incomplete | response.failed  (the end)

A non-streamed request feeds the same builder and keeps only `response()`.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

from services.common.openai_api.completions_output import UsageCounts

__all__ = ["ResponseBuilder", "event_sse", "new_response_id", "usage_object"]

# OpenAI's closed set of `response.error.code` values that can apply here;
# any other (kvmesh's own: timeout, generation_failed) is `server_error`,
# with kvmesh's code kept in the message.
_ERROR_CODES = frozenset({"server_error", "rate_limit_exceeded"})

Status = Literal["in_progress", "completed", "incomplete", "failed"]


def new_response_id() -> str:
    return f"resp_{uuid.uuid4().hex}"


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def event_sse(event: dict[str, Any]) -> bytes:
    """One event as SSE, with the `event:` line OpenAI sends."""
    data = json.dumps(event, separators=(",", ":"), ensure_ascii=False)
    return f"event: {event['type']}\ndata: {data}\n\n".encode()


def usage_object(usage: UsageCounts) -> dict[str, Any]:
    """OpenAI's usage; cache writes are not counted (always 0: the engines
    report prefix-cache hits, not what they added to the cache)."""
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }


class ResponseBuilder:
    """One response: its output items so far and the events that built them."""

    def __init__(
        self,
        response_id: str,
        model: str,
        settings: dict[str, Any],
        *,
        previous_response_id: str | None = None,
        metadata: dict[str, str] | None = None,
        store: bool = False,
        created_at: int | None = None,
    ) -> None:
        self.id = response_id
        self.model = model
        self.settings = settings
        self.previous_response_id = previous_response_id
        self.metadata = metadata or {}
        self.store = store
        self.created_at = int(time.time()) if created_at is None else created_at
        self.status: Status = "in_progress"
        self.output: list[dict[str, Any]] = []
        self.usage: dict[str, Any] | None = None
        self.error: dict[str, Any] | None = None
        self.incomplete_details: dict[str, Any] | None = None
        self._seq = 0
        self._open: dict[str, Any] | None = None  # the item being written
        self._calls: dict[int, dict[str, Any]] = {}  # parser's tool-call index -> its item
        self._index: dict[str, int] = {}  # item id -> output_index

    # ------------------------------------------------------------ objects

    def response(self) -> dict[str, Any]:
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": self.status,
            "background": False, "error": self.error, "incomplete_details": self.incomplete_details,
            "model": self.model, "output": [_copy(item) for item in self.output],
            "previous_response_id": self.previous_response_id,
            "store": self.store, "metadata": self.metadata, "usage": self.usage, "user": None,
            **self.settings,
        }

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return event

    def _at(self, item: dict[str, Any]) -> dict[str, Any]:
        return {"item_id": item["id"], "output_index": self._index[item["id"]]}

    def _add(self, item: dict[str, Any]) -> dict[str, Any]:
        self._open = item
        self._index[item["id"]] = len(self.output)
        self.output.append(item)
        return self._event("response.output_item.added", output_index=len(self.output) - 1, item=_copy(item))

    # ------------------------------------------------------------ steps

    def start(self) -> list[dict[str, Any]]:
        return [self._event("response.created", response=self.response()),
                self._event("response.in_progress", response=self.response())]

    def text(self, delta: str) -> list[dict[str, Any]]:
        if not delta:
            return []
        events: list[dict[str, Any]] = []
        item = self._open
        if item is None or item["type"] != "message":
            events += self._close()
            item = {"id": _item_id("msg"), "type": "message", "status": "in_progress", "role": "assistant",
                    "content": []}
            events.append(self._add(item))
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            item["content"].append(part)
            events.append(self._event("response.content_part.added", **self._at(item), content_index=0,
                                      part=dict(part)))
        item["content"][0]["text"] += delta
        events.append(self._event("response.output_text.delta", **self._at(item), content_index=0, delta=delta,
                                  logprobs=[]))
        return events

    def tool_call(self, index: int, call_id: str | None, name: str | None, arguments: str) -> list[dict[str, Any]]:
        """A tool-call delta as the parser gives it (chat's `tool_calls`
        delta: the first one of an index carries id and name)."""
        events: list[dict[str, Any]] = []
        item = self._calls.get(index)
        if item is None:
            events += self._close()
            item = {"id": _item_id("fc"), "type": "function_call", "status": "in_progress",
                    "call_id": call_id or _item_id("call"), "name": name or "", "arguments": ""}
            self._calls[index] = item
            events.append(self._add(item))
        elif name and not item["name"]:
            item["name"] = name
        if arguments:
            item["arguments"] += arguments
            events.append(self._event("response.function_call_arguments.delta", **self._at(item),
                                      delta=arguments))
        return events

    def _close(self, status: str = "completed") -> list[dict[str, Any]]:
        item, self._open = self._open, None
        if item is None:
            return []
        item["status"] = status
        at = self._at(item)
        if item["type"] == "function_call":
            return [self._event("response.function_call_arguments.done", **at, arguments=item["arguments"]),
                    self._event("response.output_item.done", **at, item=_copy(item))]
        part = item["content"][0]
        return [
            self._event("response.output_text.done", **at, content_index=0, text=part["text"], logprobs=[]),
            self._event("response.content_part.done", **at, content_index=0, part=dict(part)),
            self._event("response.output_item.done", **at, item=_copy(item)),
        ]

    def finish(self, reason: str, usage: UsageCounts) -> list[dict[str, Any]]:
        """The generation ended well: `length` leaves the response
        incomplete (max_output_tokens), anything else completes it."""
        incomplete = reason == "length"
        events = self._close("incomplete" if incomplete else "completed")
        self.usage = usage_object(usage)
        if incomplete:
            self.status = "incomplete"
            self.incomplete_details = {"reason": "max_output_tokens"}
            return [*events, self._event("response.incomplete", response=self.response())]
        self.status = "completed"
        return [*events, self._event("response.completed", response=self.response())]

    def fail(self, code: str, message: str) -> list[dict[str, Any]]:
        """The generation failed after the response started."""
        events = self._close("incomplete")
        self.status = "failed"
        if code not in _ERROR_CODES:
            code, message = "server_error", f"{message} ({code})"
        self.error = {"code": code, "message": message}
        return [*events, self._event("response.failed", response=self.response())]


def _copy(item: dict[str, Any]) -> dict[str, Any]:
    """An item as it is now (events must not change as the item grows)."""
    out = dict(item)
    if "content" in out:
        out["content"] = [dict(part) for part in out["content"]]
    return out
