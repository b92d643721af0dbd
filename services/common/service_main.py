"""A service process's main loop, shared by the scheduler, gateway and engine
entry points (`serve`): install SIGTERM/SIGINT handlers, start, wait for a
signal or cancellation, then stop gracefully.

Each service's own `stop()` owns its grace period (the engine's drain
timeout, the gateway's and scheduler's stream flush); this loop only makes
sure `stop()` runs, whatever ended the wait, and runs to its end even when
the caller is cancelled again meanwhile. A service that can fail as a whole
(an engine whose backend died) passes `failure`: once that returns, the
service is stopped and `ServiceFailed` raised, so the process exits
non-zero (EXIT_SERVICE_FAILED, services/cli.py) for its supervisor to
restart it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Awaitable, Callable

from services.common.gc_heap import freeze_startup_heap

__all__ = ["EXIT_SERVICE_FAILED", "ServiceFailed", "run_until_signalled"]

log = logging.getLogger(__name__)

_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
# The exit code of a service process that failed as a whole.
EXIT_SERVICE_FAILED = 3


class ServiceFailed(RuntimeError):
    """The service could no longer serve (the message says why): it was
    stopped, and its process exits non-zero for a restart."""


async def run_until_signalled(
    name: str,
    start: Callable[[], Awaitable[object]],
    stop: Callable[[], Awaitable[None]],
    *,
    freeze_heap: bool,
    failure: Callable[[], Awaitable[str]] | None = None,
) -> None:
    """Start the service, serve until SIGTERM/SIGINT or cancellation, stop.

    `freeze_heap` freezes the start-up heap once started (see gc_heap); an
    engine freezes its own earlier, before it turns SERVING. A failed start
    still runs `stop()`, which releases whatever was bound. Returns after a
    signal (exit 0); a cancellation is re-raised once stopped. `failure`
    returns (the reason) once the service failed as a whole: it is then
    stopped and ServiceFailed raised.
    """
    loop = asyncio.get_running_loop()
    stopping = asyncio.Event()
    installed: list[signal.Signals] = []
    for sig in _STOP_SIGNALS:
        # Only possible in the main thread; in-process callers cancel instead.
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(sig, stopping.set)
            installed.append(sig)
    failed: list[str] = []
    watcher: asyncio.Task[None] | None = None

    async def watch(failure: Callable[[], Awaitable[str]]) -> None:
        failed.append(await failure())
        stopping.set()

    try:
        await start()
        if freeze_heap:
            freeze_startup_heap()
        if failure is not None:
            watcher = asyncio.create_task(watch(failure), name=f"{name}-failure")
        await stopping.wait()
        if failed:
            log.error("%s failed (%s): stopping, then exiting with code %d for a restart",
                      name, failed[0], EXIT_SERVICE_FAILED)
        else:
            log.info("%s stopping on signal", name)
    finally:
        if watcher is not None:
            watcher.cancel()
        for sig in installed:
            loop.remove_signal_handler(sig)
        await asyncio.shield(stop())
    if failed:
        raise ServiceFailed(f"{name} failed: {failed[0]}")
