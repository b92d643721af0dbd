"""The sim's warm-up generation, and the test knob that skips it
(`sim.warm_up`: a sim slowed to 12 s tokens would spend ~24 s warming up)."""

from __future__ import annotations

import pytest
from engine_helpers import engine_config, mesh_config, prompt_of, request

from services.engine.backend import RequestPhases
from services.engine.sim import SimBackend


class Steps:
    def __init__(self) -> None:
        self.tokens = 0

    def step(self, seconds: float | None, tokens: int, preempted: int) -> None:
        self.tokens += tokens

    def inter_token(self, seconds: float) -> None:
        pass

    def request_phases(self, phases: RequestPhases) -> None:
        pass


@pytest.mark.parametrize("warm_up", [True, False])
async def test_warm_up_runs_a_generation_unless_switched_off(warm_up: bool) -> None:
    engine = engine_config()
    engine.sim.warm_up = warm_up
    backend = SimBackend(mesh_config(), engine)
    steps = Steps()
    backend.set_step_observer(steps)
    await backend.start()
    try:
        assert (steps.tokens > 0) is warm_up
        outs = [out async for out in backend.generate(request("r", prompt_of(8), max_tokens=3))]
        assert sum(len(o.token_ids) for o in outs) == 3 and outs[-1].finish_reason == "length"
    finally:
        await backend.stop()
