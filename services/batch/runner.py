"""The batch runner of the batch service: every `batch.poll_seconds` it
renews the ownership leases it holds (ownership.py), reacts to cancellation
and expiry of its batches, claims active batches nobody owns (new ones, and
those of a process that stopped renewing: its predecessor before a
restart) and runs each in a `BatchRun`
(batch_run.py). Lines of all its batches share one adaptive gate (gate.py,
pacing.py), at most `batch.max_in_flight`.

One owner of the runner's state: the service's event loop (`_owned` is
touched only by `_tick` and `stop`); database calls go to the store's
worker thread. A lost lease (another process took the batch over) stops
that batch's run at once, without another write: its writes would be
refused by the fence anyway.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from services.batch.batch_run import BatchRun, RunDeps
from services.batch.callers import Callers
from services.batch.records import ACTIVE, FINAL

__all__ = ["BatchRunner"]

log = logging.getLogger(__name__)


class BatchRunner:
    def __init__(self, deps: RunDeps, keys: Callers, owner: str) -> None:
        self._deps = deps
        self._keys = keys
        self.owner = owner   # this process's lease holder id (host, pid, random)
        self._owned: dict[str, tuple[BatchRun, asyncio.Task[None]]] = {}
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="batch-runner")

    async def stop(self) -> None:
        """Stop running, and give up the leases so the next process takes
        the batches at its next poll (their lines in flight are cut here:
        their gateways keep the generations, and the next owner resumes them)
        -- or, where a send was cut mid-way, once that send's admit-by time
        has passed (ownership.py): it might still be admitted until then."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for run, task in self._owned.values():
            run.abandon()
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            with contextlib.suppress(Exception):
                await self._deps.db.run(self._deps.db.store.release, run.lease, run.sends_cut_until)
        self._owned.clear()

    async def _loop(self) -> None:
        while True:
            try:
                await self._tick()
            except Exception:
                log.exception("batch runner: poll failed; trying again")
            await asyncio.sleep(self._deps.config.poll_seconds)

    async def _tick(self) -> None:
        await self._renew()
        if not self._deps.gate.closed:  # a draining service takes no new batches
            await self._claim()
        deps = self._deps
        counts = await deps.db.run(deps.db.store.status_counts)
        for status in (*ACTIVE, *FINAL):
            deps.metrics.batches.labels(status).set(counts.get(status, 0))
        deps.metrics.in_flight_limit.set(deps.gate.window.size)

    async def _renew(self) -> None:
        deps, store = self._deps, self._deps.db.store
        for batch_id, (run, task) in list(self._owned.items()):
            if task.done():
                del self._owned[batch_id]
                if deps.gate.closed:  # drained: the batch's next lines run in the next process
                    await deps.db.run(store.release, run.lease, run.sends_cut_until)
                continue
            lease = await deps.db.run(store.renew, run.lease, deps.clock.wall(), deps.config.lease_seconds)
            if lease is None:
                log.warning("batch %s: lease lost to another batch process; stopping here", batch_id)
                run.abandon()
                task.cancel()
                del self._owned[batch_id]
                continue
            run.lease = lease
            batch = await deps.db.run(store.get_batch, None, batch_id)
            self._stop_if_due(run, batch)

    def _stop_if_due(self, run: BatchRun, batch: dict[str, Any] | None) -> None:
        if batch is None or batch["status"] == "cancelling":
            run.stop("cancelled")
        elif batch["status"] == "in_progress" and self._deps.clock.wall() >= batch["expires_at"]:
            run.stop("expired")

    async def _claim(self) -> None:
        deps, store = self._deps, self._deps.db.store
        for batch_id in await deps.db.run(store.runnable_batches, self.owner, deps.clock.wall()):
            if batch_id in self._owned:
                continue
            lease = await deps.db.run(store.claim, batch_id, self.owner, deps.clock.wall(), deps.config.lease_seconds)
            batch = await deps.db.run(store.get_batch, None, batch_id)
            creator = await deps.db.run(store.batch_owner_key, batch_id)
            if lease is None or batch is None or creator is None:
                continue
            log.info("batch %s: owned by %s (epoch %d), status %s, %d of %d lines done", batch_id, self.owner,
                     lease.epoch, batch["status"], batch["request_counts"]["completed"]
                     + batch["request_counts"]["failed"], batch["request_counts"]["total"])
            run = BatchRun(deps, lease, batch, creator[0], self._keys.principal_for(creator[1]))
            self._stop_if_due(run, batch)
            self._owned[batch_id] = (run, asyncio.create_task(self._guarded(run), name=f"batch-{batch_id}"))

    @staticmethod
    async def _guarded(run: BatchRun) -> None:
        try:
            await run.run()
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("batch %s: run failed; the next poll takes it up again", run.lease.batch_id)
