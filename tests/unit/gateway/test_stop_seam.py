"""The stop-string seam across migrations (`StopSeam`), step by step.

Each case is a request's life as the driver drives the seam: engine deltas
(`text`, `held_text`) -> (text sent, stopped); an engine lost after N tokens
-> whether a stop string completed; an engine's finish or the end without it
-> the last text sent. What is sent must be what an unbroken run would send.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from services.gateway.stop_seam import StopSeam


@dataclass(frozen=True)
class Delta:
    text: str
    held: str
    sent: str
    stopped: bool = False


@dataclass(frozen=True)
class Lost:
    generated: int
    stopped: bool = False


@dataclass(frozen=True)
class Finished:
    sent: str


@dataclass(frozen=True)
class Flush:
    sent: str


Step = Delta | Lost | Finished | Flush

CASES: dict[str, tuple[list[str], int, list[Step]]] = {
    "no stops: text passes through, the seam changes nothing": (
        [], 0, [Delta("hello", "", "hello"), Lost(1), Delta(" world", "", " world"), Finished("")],
    ),
    "held text of the dead engine goes out before the next engine's text": (
        ["STOP"], 0, [Delta("hello ", "ST", "hello "), Lost(2), Delta("AR wars", "", "STAR w"), Finished("ars")],
    ),
    "a stop string split across the seam stops the request": (
        ["STOP"], 0, [Delta("hello ", "ST", "hello "), Lost(2), Delta("OP more", "", "", stopped=True)],
    ),
    "a stop split across the seam, ending in what the next engine holds back": (
        ["STOP"], 0, [Delta("hi ", "S", "hi "), Lost(2), Delta("", "TO", ""), Delta("", "TOP", "", stopped=True)],
    ),
    "a stop string entirely in the carried held text ends the request at the seam": (
        ["STOP"], 0, [Delta("a", "xSTOPy", "a"), Lost(3, stopped=True), Flush("x")],
    ),
    "min_tokens not reached: no stop applies at the seam, held text goes out": (
        ["STOP"], 5, [Delta("hello ", "ST", "hello "), Lost(2), Delta("OP", "", "STOP"), Finished("")],
    ),
    "min_tokens reached at the seam: the stop applies": (
        ["STOP"], 2, [Delta("hello ", "ST", "hello "), Lost(2), Delta("OP", "", "", stopped=True)],
    ),
    "an engine lost before its first delta: the held text is carried again": (
        ["STOP"], 0, [Delta("a ", "ST", "a "), Lost(2), Lost(2), Delta("OP", "", "", stopped=True)],
    ),
    "text released at a seam, then the next engine lost before its first delta": (
        [], 5, [Delta("a ", "ST", "a "), Lost(1), Lost(1), Delta("b", "", "STb"), Finished("")],
    ),
    "every token arrived but the finish was lost: held text is flushed": (
        ["STOP"], 0, [Delta("a ", "ST", "a "), Flush("ST")],
    ),
    "after a seam the finish releases what the seam still holds": (
        ["STOP"], 0, [Delta("a ", "ST", "a "), Lost(2), Delta("", "", ""), Finished("ST")],
    ),
    "the engine's own held text at its finish is its own to drop": (
        ["STOP"], 0, [Delta("a ", "ST", "a "), Finished("")],
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_stop_seam(name: str) -> None:
    stops, min_tokens, steps = CASES[name]
    seam = StopSeam(stops, min_tokens)
    for i, step in enumerate(steps):
        where = f"step {i}: {step}"
        if isinstance(step, Delta):
            assert seam.on_delta(step.text, step.held) == (step.sent, step.stopped), where
        elif isinstance(step, Lost):
            assert seam.on_engine_lost(step.generated) is step.stopped, where
        elif isinstance(step, Finished):
            assert seam.on_finished() == step.sent, where
        else:
            assert seam.flush() == step.sent, where
