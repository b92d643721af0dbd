"""Stop strings applied to streamed text the way vLLM applies them: the stop
string itself is not returned, and up to len(longest stop) - 1 characters are
held back while streaming, so a stop string spanning two tokens is never
half-sent.

Used by the sim engine for its own output, and by the gateway across a
migration seam: the text a dead engine held back, followed by the next
engine's text, may complete a stop string neither engine saw whole.
"""

from __future__ import annotations

__all__ = ["StopText"]


class StopText:
    """Per-request text assembly with stop strings and hold-back."""

    __slots__ = ("_stops", "_hold", "_buffer")

    def __init__(self, stops: list[str]) -> None:
        self._stops = [s for s in stops if s]
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self._buffer = ""

    def add(self, piece: str) -> tuple[str, bool]:
        """Append text; returns (text safe to send now, stopped)."""
        if not self._stops:
            return piece, False
        self._buffer += piece
        cut = self._first(self._buffer)
        if cut >= 0:
            out, self._buffer = self._buffer[:cut], ""
            return out, True
        keep = min(self._hold, len(self._buffer))
        out = self._buffer[: len(self._buffer) - keep]
        self._buffer = self._buffer[len(self._buffer) - keep :]
        return out, False

    def first_stop(self, lookahead: str) -> int:
        """Where the first stop string begins in the held text followed by
        `lookahead` (text not taken in), or -1."""
        return self._first(self._buffer + lookahead)

    def _first(self, text: str) -> int:
        return min((i for i in (text.find(s) for s in self._stops) if i >= 0), default=-1)

    @property
    def held(self) -> str:
        """Text taken in but not yet returned (a possible stop-string start)."""
        return self._buffer

    def flush(self) -> str:
        """What is held back, at a finish that was not a stop string."""
        out, self._buffer = self._buffer, ""
        return out
