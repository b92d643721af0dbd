"""Stop strings across a migration seam: the text of one request not sent yet.

An engine applies the request's stop strings to its own text and holds back
a tail that may begin one (`EngineDelta.held_text`, never sent). When that
engine dies, the request resumes on another engine, and a stop string that
begins in the dead engine's held tail and ends in the next engine's text is
seen whole by neither. A preemption is the same seam: the gateway stops the
engine stream itself and the request continues where it is placed next.
`StopSeam` carries the held tail across the seam and, from then on, applies
the stop strings itself to that tail followed by the next engine's text
(`services.common.stop_text.StopText`, the engines' own rules), so the client
sees what an unbroken run would have sent.

Ownership: one `StopSeam` per request, used only by the request's pump task
(the driver): `on_delta` for every engine delta, `on_engine_lost` when an
engine fails or the request is preempted, and the request will move;
`on_finished` when an engine finishes; `flush` when the request ends without
an engine's `finished`.
"""

from __future__ import annotations

from services.common.stop_text import StopText

__all__ = ["StopSeam"]


class StopSeam:
    """The request's unsent text across engine failures."""

    def __init__(self, stops: list[str], min_tokens: int) -> None:
        self._stops = stops
        self._min_tokens = min_tokens
        # Since the last migration where a stop string could apply: the stop
        # strings over the carried text followed by the current engine's text.
        self._seam: StopText | None = None
        # Text the seam released, not sent yet: it goes out in front of the
        # next engine's first delta (or at the end).
        self._released = ""
        # Text not sent because it may begin a stop string: the seam's own
        # hold followed by what the engine holds back (its `held_text`).
        self._held = ""

    def on_delta(self, text: str, held_text: str) -> tuple[str, bool]:
        """An engine delta's `text` and `held_text` -> (text to send with the
        delta, whether a stop string ended the request)."""
        stopped = False
        seam = self._seam
        if seam is not None:
            text, stopped = seam.add(text)
            cut = -1 if stopped or not held_text else seam.first_stop(held_text)
            if cut >= 0:
                # The stop ends inside what this engine holds back for its
                # own stop strings: it is there already, so stop now rather
                # than one token later, as an unbroken run would.
                text += (seam.held + held_text)[:cut]
                stopped = True
        text, self._released = self._released + text, ""
        self._held = (seam.held if seam is not None else "") + held_text
        return text, stopped

    def on_engine_lost(self, generated: int) -> bool:
        """The engine failed (or the request was preempted) after `generated`
        tokens in all and the request resumes on the next engine: carry the text held back so far (a possible
        stop-string start, never sent) across the seam. True if that text
        already completes a stop string: the request is finished, and
        `flush()` is what precedes the stop."""
        # Also what an earlier seam released or held for an engine that then
        # failed before its first delta.
        carried, self._held = self._released + self._held, ""
        if not self._stops or generated < self._min_tokens:
            # No stop can apply here: the held text just goes out first.
            self._seam, self._released = None, carried
            return False
        self._seam = StopText(self._stops)
        self._released, stopped = self._seam.add(carried)
        self._held = self._seam.held
        return stopped

    def on_finished(self) -> str:
        """The engine finished: the last text to send (what the seam still
        holds began no stop string after all). What the engine held back is
        its own to send or drop before it finishes."""
        tail = self._released + (self._seam.flush() if self._seam is not None else "")
        self._released = ""
        return tail

    def flush(self) -> str:
        """The request ends without the engine's `finished` (every token
        arrived, or a stop string completed across the seam): everything not
        sent yet."""
        tail, self._released, self._held = self._released + self._held, "", ""
        return tail
