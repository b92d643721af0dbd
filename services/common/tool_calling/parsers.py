"""Tool calls read out of a model's streamed text (the gateway's job).

A `ToolCallParser` is fed the text deltas of one generation and returns
events: `TextOut` (content, passed through as it comes, less what might
still turn into a call), `CallStart` (a call begins: index, id "call_...",
function name) and `CallArguments` (the next fragment of that call's
arguments JSON text). `finish()` flushes what it held back. Joined, a call's
fragments are the arguments JSON as the model wrote it; however the text is
split into deltas, the events add up to the same content and calls. This is
the API the chat transports use (chat_output.py, grpc_mapping.py) and the
Responses API (responses_output.py): `parser_for(generation, model_parser)` picks the
parser of a request (None: nothing to parse), `collect(parser, text)` parses
a whole text into (content, calls).

Parsers, by the name a model gives in config (`models[].tool_parser`):
- "hermes" (vLLM's reference format): a call is a `<tool_call>` block holding
  one JSON object `{"name": ..., "arguments": {...}}` ("parameters" is
  accepted for "arguments"), then `</tool_call>`. Text around the blocks is
  content. A block whose JSON is not a call stays content, tags included.
- "json": the output IS the call -- a bare JSON object as above, or a JSON
  array of them, after optional whitespace; any other output is content.
  A request whose `tool_choice` is "required" or a named function is parsed
  with it whatever the model's parser: its output is constrained to that
  JSON (request.py `tool_call_schema`; the choice of format: call_format.py).

Streaming: a call's `CallStart` goes out as soon as its name is complete and
its arguments object has begun (`{"name": "f", "arguments": {`); then its
arguments text streams as it arrives. An object that does not start that way
(another key order, arguments given as a JSON string) is read whole at its
end. Content is released at once except a possible start of a call tag and
trailing whitespace, which is dropped before a call (so a message whose
output is only calls has content None). Once a call started it stays a call,
even if the model then breaks its JSON (OpenAI's own arguments may be
invalid JSON too; a client must check them).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from services.common.config import TOOL_PARSERS
from services.common.tool_calling.call_format import call_format, offered_tools
from services.common.tool_calling.call_json import (
    CallArguments,
    CallObject,
    CallStart,
    TextOut,
    ToolEvent,
    calls_in,
    new_call_id,
)

if TYPE_CHECKING:
    from services.common.openai_api.requests import GenerationInput

__all__ = [
    "PARSERS",
    "CallArguments",
    "CallStart",
    "TextOut",
    "ToolCallParser",
    "ToolEvent",
    "collect",
    "new_call_id",
    "parser_for",
]


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that begins `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ToolCallParser:
    """Base: content release with trailing whitespace held (module docstring)."""

    name = ""

    def __init__(self) -> None:
        self.calls = 0        # calls started so far
        self._buf = ""        # text not yet handled
        self._held = ""       # trailing whitespace of the content so far
        self._object: CallObject | None = None  # the call object being read

    def feed(self, text: str) -> list[ToolEvent]:  # pragma: no cover - per subclass
        raise NotImplementedError

    def finish(self) -> list[ToolEvent]:  # pragma: no cover - per subclass
        raise NotImplementedError

    def _text(self, text: str, out: list[ToolEvent]) -> None:
        if not text:
            return
        text = self._held + text
        body = text.rstrip()
        self._held = text[len(body):]
        if body:
            out.append(TextOut(body))

    def _events(self, events: list[ToolEvent], out: list[ToolEvent]) -> None:
        for event in events:
            if isinstance(event, CallStart):
                self._held = ""  # whitespace before a call is not content
                self.calls = max(self.calls, event.index + 1)
            out.append(event)

    def _feed_object(self, out: list[ToolEvent]) -> tuple[CallObject, str] | None:
        """Feed the buffer to the call object being read, its events to `out`;
        returns the object and the text after it, None while it is incomplete."""
        call = self._object
        if call is None:  # pragma: no cover - the object state always has one
            raise RuntimeError("no call object")
        events, rest = call.feed(self._buf)
        self._buf = ""
        self._events(events, out)
        return None if rest is None else (call, rest)

    def _end(self, out: list[ToolEvent]) -> list[ToolEvent]:
        if self._held and not self.calls:
            out.append(TextOut(self._held))
        self._held = ""
        return out


class HermesParser(ToolCallParser):
    """`<tool_call>{...}</tool_call>` blocks (module docstring)."""

    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        super().__init__()
        self._state = "text"  # text | lead | object | raw | after
        self._lead = ""       # whitespace between the open tag and the JSON

    def feed(self, text: str) -> list[ToolEvent]:
        out: list[ToolEvent] = []
        self._buf += text
        while self._buf and self._step(out):
            pass
        return out

    def _step(self, out: list[ToolEvent]) -> bool:
        """Handle the buffer in the current state; False: wait for more."""
        buf = self._buf
        if self._state == "text":
            at = buf.find(self.OPEN)
            if at < 0:
                keep = _partial_suffix(buf, self.OPEN)
                self._text(buf[:len(buf) - keep], out)
                self._buf = buf[len(buf) - keep:]
                return False
            self._text(buf[:at], out)
            self._buf, self._state, self._lead = buf[at + len(self.OPEN):], "lead", ""
            return True
        if self._state == "lead":
            body = buf.lstrip()
            self._lead += buf[:len(buf) - len(body)]
            self._buf = body
            if not body:
                return False
            if body[0] == "{":
                self._state, self._object = "object", CallObject(self.calls)
            else:
                self._state = "raw"
            return True
        if self._state == "object":
            return self._in_object(out)
        if self._state == "raw":
            return self._in_raw(out)
        return self._after(out)

    def _in_object(self, out: list[ToolEvent]) -> bool:
        done = self._feed_object(out)
        if done is None:
            return False
        call, rest = done
        if call.started:
            self._state = "after"
        else:  # not a call: the block is content
            self._text(self.OPEN + self._lead + call.buf, out)
            self._state = "text"
        self._buf, self._object = rest, None
        return True

    def _in_raw(self, out: list[ToolEvent]) -> bool:
        at = self._buf.find(self.CLOSE)
        if at < 0:
            return False
        inside, self._buf = self._buf[:at], self._buf[at + len(self.CLOSE):]
        events = calls_in(inside, self.calls)
        if events is None:
            self._text(self.OPEN + self._lead + inside + self.CLOSE, out)
        else:
            self._events(events, out)
        self._state = "text"
        return True

    def _after(self, out: list[ToolEvent]) -> bool:
        """After a call's object: skip to its close tag (a missing one is
        taken as closed when other text follows)."""
        body = self._buf.lstrip()
        if body.startswith(self.CLOSE):
            self._buf, self._state = body[len(self.CLOSE):], "text"
            return True
        if not body or self.CLOSE.startswith(body):
            return False
        self._buf, self._state = body, "text"
        return True

    def finish(self) -> list[ToolEvent]:
        out: list[ToolEvent] = []
        buf, self._buf = self._buf, ""
        if self._state == "text":
            self._text(buf, out)
        elif self._state == "lead":
            self._text(self.OPEN + self._lead, out)
        elif self._state == "object" and self._object is not None and not self._object.started:
            self._text(self.OPEN + self._lead + self._object.buf, out)
        elif self._state == "raw":
            events = calls_in(buf, self.calls)
            if events is None:
                self._text(self.OPEN + self._lead + buf, out)
            else:
                self._events(events, out)
        self._state = "text"
        return self._end(out)


class JsonParser(ToolCallParser):
    """The bare JSON call, or an array of calls (module docstring)."""

    name = "json"

    def __init__(self) -> None:
        super().__init__()
        self._state = "lead"  # lead | object | array | element | text | done
        self._raw = ""        # everything fed since the output began, until a call starts
        self._after = False   # content seen after the JSON

    def feed(self, text: str) -> list[ToolEvent]:
        out: list[ToolEvent] = []
        if not self.calls:
            self._raw += text
        self._buf += text
        while self._buf and self._step(out):
            pass
        return out

    def _as_text(self, out: list[ToolEvent]) -> bool:
        """No call after all: everything so far is content."""
        self._state, self._buf = "text", ""
        self._text(self._raw, out)
        return False

    def _step(self, out: list[ToolEvent]) -> bool:
        state = self._state
        if state in ("text", "done"):
            self._trailing(out)
            return False
        body = self._buf.lstrip()
        if not body:
            return False
        if state == "lead":
            if body[0] not in "{[":
                return self._as_text(out)
            self._state = "object" if body[0] == "{" else "array"
            self._buf = body if body[0] == "{" else body[1:]
            if self._state == "object":
                self._object = CallObject(self.calls)
            return True
        if state == "array":
            if body[0] == ",":
                self._buf = body[1:]
                return True
            if body[0] == "]":
                self._buf, self._state = body[1:], "done"
                return True
            if body[0] != "{":
                return self._as_text(out) if not self.calls else self._done(body)
            self._buf, self._state, self._object = body, "element", CallObject(self.calls)
            return True
        return self._in_object(out)

    def _trailing(self, out: list[ToolEvent]) -> None:
        """Content: all of it in text state; after the JSON, from its first
        non-space character."""
        text, self._buf = self._buf, ""
        if self._state == "done" and not self._after:
            text = text.lstrip()
            self._after = bool(text)
        self._text(text, out)

    def _done(self, body: str) -> bool:
        self._buf, self._state = body, "done"
        return True

    def _in_object(self, out: list[ToolEvent]) -> bool:
        done = self._feed_object(out)
        if done is None:
            return False
        call, rest = done
        if not call.started:
            if not self.calls:
                return self._as_text(out)
            self._text(call.buf, out)
        self._buf, self._object = rest, None
        self._state = "array" if self._state == "element" else "done"
        return True

    def finish(self) -> list[ToolEvent]:
        out: list[ToolEvent] = []
        if self._state in ("text", "done"):
            self._trailing(out)
        elif not self.calls:
            self._text(self._raw, out)
        elif self._object is not None and not self._object.started:
            self._text(self._object.buf, out)
        self._buf, self._state = "", "done"
        return self._end(out)


PARSERS: dict[str, type[ToolCallParser]] = {"hermes": HermesParser, "json": JsonParser}
if tuple(PARSERS) != TOOL_PARSERS:  # pragma: no cover - the config's list and this registry agree
    raise RuntimeError(f"tool parsers {tuple(PARSERS)} differ from the config's {TOOL_PARSERS}")


def parser_for(generation: GenerationInput, model_parser: str) -> ToolCallParser | None:
    """The parser for one request's output: None when it offers no tools
    (none, or `tool_choice` "none"); else the one of its call format
    (call_format.py: "json" when the output is forced into calls, else the
    model's own `models[].tool_parser`) -- the format its prompt asked for."""
    if offered_tools(generation) is None:
        return None
    return PARSERS[call_format(generation, model_parser)]()


def collect(parser: ToolCallParser, text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """A whole output: its content (None when empty) and its calls, in
    OpenAI's `message.tool_calls` shape."""
    content: list[str] = []
    calls: list[dict[str, Any]] = []
    for event in [*parser.feed(text), *parser.finish()]:
        if isinstance(event, TextOut):
            content.append(event.text)
        elif isinstance(event, CallStart):
            calls.append({"id": event.call_id, "type": "function",
                          "function": {"name": event.name, "arguments": ""}})
        else:
            calls[event.index]["function"]["arguments"] += event.fragment
    return "".join(content) or None, calls
