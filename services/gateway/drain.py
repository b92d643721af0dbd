"""A gateway's drain on SIGTERM (a rolling update, a scale-down): stop being
picked, finish what runs, then go -- and lose nothing that outlives it.

    drain = Drain(DrainSettings.from_config(config.gateway), metrics)
    app.middlewares.append(drain.health_middleware)      # GET /health -> 503
    open_streams = await drain.run(not_ready)            # after SIGTERM
    if open_streams:
        drain.cut(open_streams)                          # ends the process

Phases, from SIGTERM:
1. Not ready at once: `not_ready()` turns gRPC health NOT_SERVING and
   GET /health answers 503 `draining`. Everything else is served as
   before, new requests included: the load balancer may still pick this
   gateway until its health checks notice, and a refusal would reach a
   client.
2. `unready_seconds`: the load balancer's bound for noticing (Envoy:
   health-check interval x unhealthy_threshold + timeout;
   `services/launcher/envoy_config.py` checks the edge against it).
3. Wait until no request is in flight, at most until `drain_seconds` after
   SIGTERM (by default the mesh's generation bound after phase 2's: no
   generation this gateway may start is cut; `GatewayConfig.drain_bound_seconds`).
4. At that bound, streams still open are cut by `Drain.cut`: the
   process ends at once, like a crash, after logging and counting them.
   On purpose: no polite cancel reaches their engines and no `done` the
   scheduler, so each generation DETACHES on its engine (kept and buffered
   for `resume_grace_seconds`) and its client, whose connection closed
   without `[DONE]`, resumes with Last-Event-ID through another gateway.
   Anything more orderly here (cancelling handlers) would cancel the very
   generations the clients are about to resume.

Ownership: one `Drain` per gateway service, used from its event loop.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from aiohttp import web

from services.common.config import GatewayConfig
from services.gateway.errors import ErrorKind, GatewayError
from services.gateway.metrics import GatewayMetrics

__all__ = ["Drain", "DrainSettings"]

log = logging.getLogger(__name__)

_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
HEALTH_PATH = "/health"


@dataclass(frozen=True)
class DrainSettings:
    # Whole drain, SIGTERM to cut (gateway.drain_bound_seconds: drain_seconds,
    # by default the generation bound).
    drain_seconds: float
    # Until the load balancer stops picking this gateway (gateway.drain_unready_seconds).
    unready_seconds: float

    @classmethod
    def from_config(cls, gateway: GatewayConfig) -> DrainSettings:
        bound = gateway.drain_bound_seconds
        return cls(bound, min(gateway.drain_unready_seconds, bound))


class Drain:
    """The drain state of one gateway (see the module docstring)."""

    def __init__(self, settings: DrainSettings, metrics: GatewayMetrics) -> None:
        self.settings = settings
        self._metrics = metrics
        self.draining = False

    @web.middleware
    async def health_middleware(self, request: web.Request, handler: _Handler) -> web.StreamResponse:
        """GET /health fails (503) once draining; every other route is served."""
        if self.draining and request.path == HEALTH_PATH:
            raise GatewayError(ErrorKind.UNAVAILABLE, "the gateway is draining (shutting down)", code="draining")
        return await handler(request)

    async def run(self, not_ready: Callable[[], Awaitable[None]]) -> int:
        """Phases 1-3; returns how many requests are still in flight at the
        bound (0 = drained)."""
        s, streams = self.settings, self._metrics.active_streams
        loop = asyncio.get_running_loop()
        deadline = loop.time() + s.drain_seconds
        self.draining = True
        self._metrics.draining.set(1)
        await not_ready()
        log.info("drain: not ready; serving on for %g s while the load balancer notices, then up to %g s "
                 "after SIGTERM for %d in-flight request(s)", s.unready_seconds, s.drain_seconds, streams.count)
        await asyncio.sleep(s.unready_seconds)
        try:
            async with asyncio.timeout_at(deadline):
                await streams.wait_idle()
        except TimeoutError:
            pass
        if streams.count:
            return streams.count
        log.info("drain: done, nothing in flight after %.1f s", s.drain_seconds - (deadline - loop.time()))
        return 0

    def cut(self, open_streams: int, exit_process: Callable[[int], object] = os._exit) -> None:
        """Phase 4: count and log the streams still open at the bound, then
        end the process at once (exit 0: the stop was asked for). The kernel
        closes every connection; nothing is cancelled politely (module
        docstring). Returns only with another `exit_process` (tests)."""
        self._metrics.drain_cut.inc(open_streams)
        log.warning("drain: %d request(s) still in flight %g s after SIGTERM: closing their connections "
                    "WITHOUT cancelling their generations (they detach on their engines; clients resume "
                    "with Last-Event-ID elsewhere)", open_streams, self.settings.drain_seconds)
        for handler in logging.getLogger().handlers:
            handler.flush()
        sys.stdout.flush()
        sys.stderr.flush()
        exit_process(0)
