"""The keeper of detached generations (services/engine/detached.py) works
from what the runtime hands it -- a lookup of live generations and whether a
vanished caller's generation may be kept -- and never reaches back into the
runtime: the dependency runs runtime -> detached only."""

from __future__ import annotations

import ast
import asyncio
from pathlib import Path

from services.engine.backend import GenerationRequest, Sampling
from services.engine.detached import Keeper

DETACHED = Path(__file__).resolve().parents[3] / "services" / "engine" / "detached.py"


class FakeGeneration:
    def __init__(self, request_id: str) -> None:
        self.request = GenerationRequest(request_id, [1, 2, 3], Sampling(max_tokens=4))
        self.handed_over = False
        self.cancelled: list[str] = []
        self.closed = False

    @property
    def ended(self) -> bool:
        return bool(self.cancelled)

    def cancel(self, message: str) -> None:
        self.cancelled.append(message)

    def hand_over(self, message: str) -> None:
        self.handed_over = True
        self.cancel(message)

    def close(self) -> None:
        self.closed = True


def test_detached_does_not_import_the_runtime() -> None:
    modules = {node.module for node in ast.walk(ast.parse(DETACHED.read_text())) if isinstance(node, ast.ImportFrom)}
    assert "services.engine.runtime" not in modules


async def test_a_vanished_callers_generation_is_kept_only_while_the_runtime_allows() -> None:
    live: dict[str, FakeGeneration] = {}
    allowed = [True]
    keeper: Keeper[FakeGeneration] = Keeper(live.get, lambda: allowed[0], grace_seconds=30.0)
    for request_id, may_keep in (("kept", True), ("ended", False)):
        generation = live[request_id] = FakeGeneration(request_id)
        allowed[0] = may_keep
        mine = await keeper.attach(keeper.find(request_id, [1, 2, 3]))
        keeper.leave(generation, mine, delivered=False)
    assert keeper.detached_count == 1
    assert not live["kept"].cancelled and not live["kept"].closed
    assert live["ended"].cancelled and live["ended"].closed
    keeper.expire_all()
    assert keeper.detached_count == 0 and live["kept"].handed_over and live["kept"].closed
    await asyncio.sleep(0)
