"""The four boards, one module each: fleet overview, scheduler, engine,
gateway/edge. `BOARDS` is the order they are rendered and documented in."""

from __future__ import annotations

from services.observability.boards import edge, engine, fleet, scheduler
from services.observability.panels import Board

__all__ = ["BOARDS"]

BOARDS: tuple[Board, ...] = (fleet.BOARD, scheduler.BOARD, engine.BOARD, edge.BOARD)
