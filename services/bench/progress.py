"""A progress bar on stderr while a benchmark runs: redrawn in place on a
terminal (at most 5 times a second), one line per 10% otherwise (logs)."""

from __future__ import annotations

import sys
import time
from typing import TextIO

from services.bench.stats import RequestResult

__all__ = ["ProgressBar"]


class ProgressBar:
    def __init__(self, total: int, label: str = "bench", stream: TextIO | None = None, width: int = 30) -> None:
        self._total = max(1, total)
        self._label = label
        self._stream = stream or sys.stderr
        self._width = width
        self._tty = bool(getattr(self._stream, "isatty", lambda: False)())
        self._start = time.monotonic()
        self._last_draw = 0.0
        self._last_decile = -1
        self.done = self.ok = self.rejected = self.failed = 0

    def __call__(self, result: RequestResult) -> None:
        self.done += 1
        if result.ok:
            self.ok += 1
        elif result.rejected:
            self.rejected += 1
        else:
            self.failed += 1
        self._draw()

    def line(self) -> str:
        frac = min(1.0, self.done / self._total)
        filled = int(frac * self._width)
        bar = "#" * filled + "." * (self._width - filled)
        return (f"{self._label} [{bar}] {self.done}/{self._total} ok {self.ok} rejected {self.rejected} "
                f"failed {self.failed} {time.monotonic() - self._start:.1f}s")

    def _draw(self) -> None:
        now = time.monotonic()
        if self._tty:
            if now - self._last_draw >= 0.2 or self.done >= self._total:
                self._last_draw = now
                self._stream.write("\r" + self.line())
                self._stream.flush()
            return
        decile = int(10 * self.done / self._total)
        if decile != self._last_decile:
            self._last_decile = decile
            self._stream.write(self.line() + "\n")
            self._stream.flush()

    def close(self) -> None:
        if self._tty:
            self._stream.write("\r" + self.line() + "\n")
            self._stream.flush()
