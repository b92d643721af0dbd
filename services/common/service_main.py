"""A service process's main loop, shared by the scheduler, gateway and engine
entry points (`serve`): install SIGTERM/SIGINT handlers, start, wait for a
signal or cancellation, then stop gracefully.

Each service's own `stop()` owns its grace period (the engine's drain
timeout, the gateway's and scheduler's stream flush); this loop only makes
sure `stop()` runs, whatever ended the wait, and runs to its end even when
the caller is cancelled again meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Awaitable, Callable

from services.common.gc_heap import freeze_startup_heap

__all__ = ["run_until_signalled"]

log = logging.getLogger(__name__)

_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


async def run_until_signalled(
    name: str,
    start: Callable[[], Awaitable[object]],
    stop: Callable[[], Awaitable[None]],
    *,
    freeze_heap: bool,
) -> None:
    """Start the service, serve until SIGTERM/SIGINT or cancellation, stop.

    `freeze_heap` freezes the start-up heap once started (see gc_heap); an
    engine freezes its own earlier, before it turns SERVING. A failed start
    still runs `stop()`, which releases whatever was bound. Returns after a
    signal (exit 0); a cancellation is re-raised once stopped.
    """
    loop = asyncio.get_running_loop()
    stopping = asyncio.Event()
    installed: list[signal.Signals] = []
    for sig in _STOP_SIGNALS:
        # Only possible in the main thread; in-process callers cancel instead.
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(sig, stopping.set)
            installed.append(sig)
    try:
        await start()
        if freeze_heap:
            freeze_startup_heap()
        await stopping.wait()
        log.info("%s stopping on signal", name)
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)
        await asyncio.shield(stop())
