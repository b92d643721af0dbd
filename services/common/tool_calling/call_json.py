"""One tool call's JSON read incrementally, and the events a tool-call
parser emits (parsers.py has the parsers and their
contract).

`CallObject` is fed a JSON object from its `{`: once its head
`{"name": "f", "arguments": {` is complete it emits `CallStart`, then its
arguments text as `CallArguments` fragments as they arrive, until the object
closes; an object whose head does not read that way is parsed whole when it
closes (`"parameters"` for "arguments", arguments given as a JSON string,
other key orders), and is no call if it is not `{"name": str, "arguments":
...}`.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any

__all__ = ["CallArguments", "CallObject", "CallStart", "TextOut", "ToolEvent", "calls_in", "new_call_id"]


@dataclass(frozen=True)
class TextOut:
    text: str


@dataclass(frozen=True)
class CallStart:
    index: int
    call_id: str
    name: str


@dataclass(frozen=True)
class CallArguments:
    index: int
    fragment: str


ToolEvent = TextOut | CallStart | CallArguments


def new_call_id() -> str:
    """An id in OpenAI's form: call_ + 24 characters."""
    return "call_" + secrets.token_hex(12)


class _Depth:
    """Where a JSON object or array that starts at a scan's first character
    ends, scanning incrementally (strings and escapes respected)."""

    __slots__ = ("depth", "escaped", "in_string")

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escaped = False

    def scan(self, text: str, start: int) -> int | None:
        """Advance over text[start:]; the index just past the value's end,
        or None while it is open."""
        for i in range(start, len(text)):
            c = text[i]
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == '"':
                    self.in_string = False
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth <= 0:
                    return i + 1
        return None


# A call object's head, up to the first character of its arguments object.
_HEAD = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=[\[{])')


def _call_of(value: Any) -> tuple[str, str] | None:
    """(name, arguments JSON text) when `value` is a call object."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        return value["name"], arguments
    return value["name"], json.dumps(arguments, ensure_ascii=False)


class CallObject:
    """One JSON object that should be a call, fed from its `{`."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.buf = ""
        self.ended = False
        self.started = False  # its CallStart went out
        self._outer = _Depth()
        self._args = _Depth()
        self._args_at = -1     # where its arguments value begins in buf
        self._args_end: int | None = None
        self._sent = 0         # buf index up to which arguments went out

    def feed(self, text: str) -> tuple[list[ToolEvent], str | None]:
        """Events, and the text after the object once it ended."""
        start = len(self.buf)
        self.buf += text
        end = self._outer.scan(self.buf, start)
        rest = None
        if end is not None:
            self.buf, rest, self.ended = self.buf[:end], self.buf[end:], True
        events: list[ToolEvent] = []
        if not self.started:
            self._try_start(events)
        if self.started and self._args_end is None:
            scanned = self._args.scan(self.buf, max(self._args_at, start))
            upto = len(self.buf) if scanned is None else scanned
            self._args_end = scanned
            if upto > self._sent:
                events.append(CallArguments(self.index, self.buf[self._sent:upto]))
                self._sent = upto
        if self.ended and not self.started:
            events.extend(self._whole())
        return events, rest

    def _try_start(self, events: list[ToolEvent]) -> None:
        head = _HEAD.match(self.buf)
        if head is None:
            return
        try:
            name = json.loads(f'"{head.group(1)}"')
        except ValueError:
            return
        if not name:
            return
        self.started = True
        self._args_at = self._sent = head.end()
        events.append(CallStart(self.index, new_call_id(), name))

    def _whole(self) -> list[ToolEvent]:
        """The object read whole at its end (a head streaming could not use)."""
        try:
            call = _call_of(json.loads(self.buf))
        except ValueError:
            call = None
        if call is None:
            return []
        self.started = True
        return [CallStart(self.index, new_call_id(), call[0]), CallArguments(self.index, call[1])]


def calls_in(text: str, index: int) -> list[ToolEvent] | None:
    """A whole JSON text holding a call or a list of calls, as events."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    values = value if isinstance(value, list) else [value]
    calls = [_call_of(v) for v in values]
    if not calls or any(c is None for c in calls):
        return None
    events: list[ToolEvent] = []
    for i, call in enumerate(c for c in calls if c is not None):
        events += [CallStart(index + i, new_call_id(), call[0]), CallArguments(index + i, call[1])]
    return events
