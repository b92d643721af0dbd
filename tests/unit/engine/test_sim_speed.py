"""The sim's run-time speed (services/engine/sim/speed.py, speed_http.py)."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from services.common.config import ConfigError, MeshConfig, config_from_dict, validate_config
from services.common.config.engines import SimSpeedStep
from services.engine.sim.speed import SimSpeed
from services.engine.sim.speed_http import add_speed_routes


def test_schedule_then_override_then_back() -> None:
    speed = SimSpeed([SimSpeedStep(60.0, 5.0), SimSpeedStep(10.0, 2.0)], started=100.0)
    assert [speed.factor(t) for t in (100.0, 109.9, 110.0, 159.9, 160.0, 1e6)] == [1, 1, 2, 2, 5, 5]
    speed.set(0.5)
    assert speed.factor(100.0) == 0.5 and speed.now(130.0).source == "override"
    speed.clear()
    assert speed.factor(130.0) == 2.0
    with pytest.raises(ValueError):
        speed.set(-1.0)


def test_schedule_is_validated() -> None:
    ok = {"engines": {"template": {"sim": {"speed_schedule": [{"at_seconds": 5, "factor": 4}]}}}}
    validate_config(config_from_dict(MeshConfig, ok))
    bad = {"engines": {"template": {"sim": {"speed_schedule": [{"at_seconds": -1, "factor": 4}]}}}}
    with pytest.raises(ConfigError, match="speed_schedule"):
        validate_config(config_from_dict(MeshConfig, bad))


def test_http_knob_sets_shows_and_clears_the_factor() -> None:
    async def scenario() -> list[tuple[int, dict]]:
        speed = SimSpeed([], started=asyncio.get_running_loop().time())
        app = web.Application()
        add_speed_routes(app, speed)
        out = []
        async with TestClient(TestServer(app)) as client:
            for method, query in (("POST", "?factor=4"), ("GET", ""), ("POST", "?factor=nope"),
                                  ("DELETE", "")):
                response = await client.request(method, "/sim/speed" + query)
                out.append((response.status, await response.json()))
        return out

    (s1, b1), (s2, b2), (s3, b3), (s4, b4) = asyncio.run(scenario())
    assert (s1, b1["factor"], b1["source"]) == (200, 4.0, "override")
    assert (s2, b2["factor"]) == (200, 4.0)
    assert s3 == 400 and b3["error"]["param"] == "factor"
    assert (s4, b4["factor"], b4["source"]) == (200, 1.0, "schedule")
