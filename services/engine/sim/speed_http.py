"""`/sim/speed` on a sim engine's metrics/health HTTP port (speed.py).

    GET    /sim/speed             {"factor": 1.0, "source": "schedule", "elapsed_seconds": 12.5}
    POST   /sim/speed?factor=4    steps cost 4x from now on (overrides the schedule)
    DELETE /sim/speed             back to engines.sim.speed_schedule

Only a sim engine has the routes (a vLLM engine answers 404). Loopback or
the mesh's private network only, like /drain: it is a test and demo knob.
"""

from __future__ import annotations

import asyncio
import math

from aiohttp import web

from services.engine.sim.speed import SimSpeed

__all__ = ["add_speed_routes"]


def add_speed_routes(app: web.Application, speed: SimSpeed) -> None:
    def state() -> web.Response:
        now = speed.now(_loop_time())
        return web.json_response({"factor": now.factor, "source": now.source,
                                  "elapsed_seconds": round(now.elapsed_seconds, 3)})

    async def get(_request: web.Request) -> web.Response:
        return state()

    async def post(request: web.Request) -> web.Response:
        raw = request.query.get("factor", "")
        try:
            factor = float(raw)
        except ValueError:
            factor = math.nan
        if not (math.isfinite(factor) and factor >= 0):
            return web.json_response({"error": {"message": f"factor must be a finite number >= 0, got {raw!r}",
                                                "type": "invalid_request_error", "param": "factor"}},
                                     status=400)
        speed.set(factor)
        return state()

    async def delete(_request: web.Request) -> web.Response:
        speed.clear()
        return state()

    app.router.add_get("/sim/speed", get)
    app.router.add_post("/sim/speed", post)
    app.router.add_delete("/sim/speed", delete)


def _loop_time() -> float:
    return asyncio.get_running_loop().time()
