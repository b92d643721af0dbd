"""ClosedLoad: a closed-loop load from the harness's client host through
Envoy -- `workers` concurrent clients, each sending its next streamed
completion when the last one ended -- whose worker count the test changes
while it runs (heavy, then light, then none). Every stream is kept, so a
test can count the ones that did not end well (lost)."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field

import aiohttp

from tests.netns.client import Stream, run_on, stream_completion

from .cluster import Cluster

__all__ = ["ClosedLoad"]


@dataclass
class ClosedLoad:
    cluster: Cluster
    url: str
    api_key: str
    model: str
    tokens: int
    workers: int = 0
    streams: list[Stream] = field(default_factory=list)
    error: BaseException | None = None
    _thread: threading.Thread | None = None

    def start(self, workers: int, timeout: float) -> None:
        self.workers = workers
        self._thread = threading.Thread(target=self._run, args=(timeout,), daemon=True)
        self._thread.start()

    def stop(self, timeout: float) -> None:
        """No new streams; wait for those running to end."""
        self.workers = 0
        if self._thread is not None:
            self._thread.join(timeout)
            assert not self._thread.is_alive(), f"the load's streams still running {timeout} s after the stop"
        if self.error is not None:
            raise self.error

    def running(self) -> int:
        return sum(1 for s in self.streams if not s.done and s.error is None)

    def lost(self) -> list[Stream]:
        return [s for s in self.streams if (s.done or s.error is not None) and not s.ok]

    def _run(self, timeout: float) -> None:
        try:
            run_on(self.cluster.net.hosts["client"], self._main, timeout=timeout)
        except BaseException as exc:  # noqa: BLE001 - the test thread re-raises it in stop()
            self.error = exc

    async def _main(self) -> None:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            tasks: dict[int, asyncio.Task[None]] = {}
            while self.workers or tasks:
                for i in range(self.workers):
                    if i not in tasks:
                        tasks[i] = asyncio.create_task(self._worker(session, i))
                for i, t in list(tasks.items()):
                    if t.done():
                        del tasks[i]
                        t.result()
                await asyncio.sleep(0.05)

    async def _worker(self, session: aiohttp.ClientSession, index: int) -> None:
        n = 0
        while index < self.workers:
            s = Stream(f"autoscale worker {index} request {n}: tell me about pods and nodes.", self.tokens,
                       model=self.model)
            self.streams.append(s)
            await stream_completion(session, self.url, s, api_key=self.api_key)
            n += 1
