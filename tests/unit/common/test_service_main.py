"""The shared main loop of the services: a signal or a cancellation ends the
wait, and stop() runs whatever ended it, a failed start included."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from services.common.service_main import ServiceFailed, run_until_signalled


class Service:
    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.events: list[str] = []

    async def start(self) -> None:
        self.events.append("start")
        if self.fail:
            raise OSError("port taken")

    async def stop(self) -> None:
        self.events.append("stop")


async def test_sigterm_stops_the_service_and_returns(caplog: pytest.LogCaptureFixture) -> None:
    service = Service()
    caplog.set_level("INFO")
    task = asyncio.create_task(run_until_signalled("svc", service.start, service.stop, freeze_heap=False))
    while not service.events:
        await asyncio.sleep(0.01)
    if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
        task.cancel()
        pytest.skip("signal handlers need the main thread")
    os.kill(os.getpid(), signal.SIGTERM)
    await asyncio.wait_for(task, 5)
    assert service.events == ["start", "stop"]
    assert "svc stopping on signal" in caplog.text
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # handlers removed again


async def test_cancellation_stops_the_service_and_propagates() -> None:
    service = Service()
    task = asyncio.create_task(run_until_signalled("svc", service.start, service.stop, freeze_heap=False))
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert service.events == ["start", "stop"]


async def test_a_failed_start_still_stops_and_raises() -> None:
    service = Service(fail=True)
    with pytest.raises(OSError, match="port taken"):
        await run_until_signalled("svc", service.start, service.stop, freeze_heap=False)
    assert service.events == ["start", "stop"]


async def test_a_service_that_fails_is_stopped_and_raises_service_failed() -> None:
    service = Service()
    broken = asyncio.Event()

    async def failure() -> str:
        await broken.wait()
        return "backend dead: core exited"

    task = asyncio.create_task(run_until_signalled("svc", service.start, service.stop, freeze_heap=False,
                                                   failure=failure))
    await asyncio.sleep(0.05)
    assert service.events == ["start"]
    broken.set()
    with pytest.raises(ServiceFailed, match="svc failed: backend dead: core exited"):
        await asyncio.wait_for(task, 5)
    assert service.events == ["start", "stop"]
