"""A Responses request's generated text, split into what the response shows:
plain text, and tool calls. The splitting is the chat path's own (the
model's tool-call parser named in the config); this module only adapts it
to the pieces a `ResponseBuilder` takes.

Pieces, in order: a `str` is output text; a `CallPiece` is a tool-call delta
(the first of an index carries its id and name, later ones more argument
text), as chat's streamed `tool_calls` deltas are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from services.common.openai_api.requests import GenerationInput
from services.common.tool_calling.parsers import CallStart, TextOut, ToolCallParser, ToolEvent, parser_for

__all__ = ["CallPiece", "OutputPiece", "OutputSplitter", "PlainText", "ToolSplitter", "splitter_for"]


@dataclass(frozen=True)
class CallPiece:
    index: int
    call_id: str | None
    name: str | None
    arguments: str


OutputPiece = str | CallPiece


class OutputSplitter(Protocol):
    def feed(self, text: str) -> list[OutputPiece]:
        """Pieces the text received so far settles (may hold some back)."""

    def finish(self) -> list[OutputPiece]:
        """What was held back, at the end of the generation."""


class PlainText:
    """No tools: all of it is text."""

    def feed(self, text: str) -> list[OutputPiece]:
        return [text] if text else []

    def finish(self) -> list[OutputPiece]:
        return []


class ToolSplitter:
    """The chat path's tool-call parser, its events as pieces."""

    def __init__(self, parser: ToolCallParser) -> None:
        self._parser = parser

    def feed(self, text: str) -> list[OutputPiece]:
        return _pieces(self._parser.feed(text))

    def finish(self) -> list[OutputPiece]:
        return _pieces(self._parser.finish())


def _pieces(events: list[ToolEvent]) -> list[OutputPiece]:
    out: list[OutputPiece] = []
    for event in events:
        if isinstance(event, TextOut):
            out.append(event.text)
        elif isinstance(event, CallStart):
            out.append(CallPiece(event.index, event.call_id, event.name, ""))
        else:
            out.append(CallPiece(event.index, None, None, event.fragment))
    return out


def splitter_for(generation: GenerationInput, model_parser: str) -> OutputSplitter:
    """The splitter for one request: the parser the chat path would use
    (`tool_calls.parser_for`: none without tools or with tool_choice none,
    "json" when the choice forces calls, else the model's), or plain text."""
    parser = parser_for(generation, model_parser)
    return PlainText() if parser is None else ToolSplitter(parser)
