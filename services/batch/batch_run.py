"""One owned batch's run: its open lines through the gate (gate.py) to the
executor (submit.py: a gateway's HTTP API), each result recorded under the
ownership fence, then the batch finalized (output / error files, final
status). The runner (runner.py) starts one per batch it owns and stops it
on cancellation, expiry, a lost lease or the batch service's stop.

"Runs no request twice" (README "Batch API"): a line is recorded done at
most once (`record_result` is fenced and only moves a line that is not
done), so the output has exactly one line per custom_id; a line is
admitted under a fresh request id `<batch>-<line>-<attempt>` only after
that attempt was written (fenced) as running; a new owner first RESUMES a
line the old one left running (same request id: the generation continues
on its engine, not from the start) and reruns it only when that generation
is gone (still queued at the crash, past `resume.grace_seconds`, or moved
to another engine just before). Every send, resumes included, is claimed
under the lease first and carries an admit-by time (ownership.py), so an
owner that was taken over gets no line admitted. A line whose connection broke after it was
sent (its gateway died) is resumed the same way.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

from services.batch.gate import Gate
from services.batch.metrics import BatchMetrics
from services.batch.output import files_of, response_line
from services.batch.ownership import Lease
from services.batch.pacing import Pace
from services.batch.records import LineRecord
from services.batch.store import Database
from services.batch.submit import Attempt, LineExecutor, Outcome, Result
from services.common.clock import Clock
from services.common.config.batch import BatchConfig
from services.common.openai_api.errors import ApiError, ErrorKind, http_error
from services.gateway.keys import Principal

__all__ = ["BatchRun", "LostLease", "RunDeps"]

log = logging.getLogger(__name__)

_PAGE = 256   # open lines read per query


class LostLease(Exception):
    """Another batch process owns the batch now: stop without writing."""


@dataclass(frozen=True)
class RunDeps:
    config: BatchConfig
    db: Database
    executor: LineExecutor
    gate: Gate
    metrics: BatchMetrics
    clock: Clock


class BatchRun:
    def __init__(self, deps: RunDeps, lease: Lease, batch: dict[str, Any], tenant: str,
                 principal: Principal | None) -> None:
        self._deps = deps
        self.lease = lease
        self._batch = batch
        self._tenant = tenant
        self._principal = principal
        self._lines: set[asyncio.Task[None]] = set()
        self.stop_as: str | None = None   # "cancelled" | "expired": stop and finalize so
        # The latest lease expiry a send cut off mid-way was claimed under
        # (_send): the lease is released no earlier (0: none cut).
        self.sends_cut_until = 0.0

    def stop(self, final_status: str) -> None:
        """Start no more lines, cancel those in flight, end as `final_status`."""
        if self.stop_as is None:
            self.stop_as = final_status
            for task in self._lines:
                task.cancel()

    def abandon(self) -> None:
        """Stop here without finalizing (the lease is lost, or the service
        stops): cancel the lines in flight; they stay open for the next owner
        (which resumes them: their gateways keep batch lines' generations)."""
        for task in self._lines:
            task.cancel()

    async def run(self) -> None:
        status = self._batch["status"]
        if status == "in_progress":
            await self._dispatch()
            await asyncio.gather(*self._lines, return_exceptions=True)
        if self.stop_as is None and status in ("in_progress", "finalizing"):
            open_lines = await self._deps.db.run(self._deps.db.store.open_lines, self.lease.batch_id, 0, 1)
            if open_lines:
                return  # a line lost its write (fenced): the runner looks again at its next poll
        await self._finalize(self.stop_as or ("cancelled" if status == "cancelling" else "completed"))

    async def _dispatch(self) -> None:
        db, after = self._deps.db, 0
        while self.stop_as is None:
            page = await db.run(db.store.open_lines, self.lease.batch_id, after, _PAGE)
            if not page:
                return
            for line in page:
                if not await self._deps.gate.acquire():
                    return
                if self.stop_as is not None:
                    self._deps.gate.release()
                    return
                task = asyncio.create_task(self._line(line), name=f"batch-line-{line.batch_id}-{line.line}")
                self._lines.add(task)
                task.add_done_callback(self._lines.discard)
                after = line.line

    async def _line(self, line: LineRecord) -> None:
        try:
            await self._run_line(line)
        except asyncio.CancelledError:
            pass  # stopped: the line stays open (cancelled/expired lines go to the error file)
        except LostLease:
            log.warning("batch %s: lost its lease while line %d ran", self.lease.batch_id, line.line)
        except Exception:
            log.exception("batch %s line %d failed", self.lease.batch_id, line.line)
        finally:
            self._deps.gate.release()

    async def _run_line(self, line: LineRecord) -> None:
        deps = self._deps
        if self._principal is None:
            error = http_error(ApiError(ErrorKind.UNAUTHENTICATED, "the API key that created this batch is "
                                            "no longer configured", code="invalid_api_key"))
            await self._record(line, Result(Outcome.DONE, Pace.NEUTRAL, response_line(
                line.custom_id, "", error.status, error.body)))
            return
        # A line its previous owner left running: its generation may still be on its engine.
        resume = line.state == "running" and line.epoch != self.lease.epoch and bool(line.request_id)
        attempt, request_id, backoff, failures = line.attempt, line.request_id, 0.5, 0
        while True:
            if not resume:
                attempt += 1
                request_id = f"{line.batch_id}-{line.line}-{attempt}"
            result = await self._send(line, Attempt(
                self._batch["endpoint"], line.request(), line.custom_id, request_id,
                float(self._batch["expires_at"]), resume), attempt, self._principal.key_id)
            deps.gate.observe(result.pace)
            if result.outcome is Outcome.DONE:
                if resume:
                    deps.metrics.requests.labels("resumed").inc()
                await self._record(line, result)
                return
            if result.outcome is Outcome.RERUN:
                deps.metrics.requests.labels("rerun").inc()
                resume = False
                continue
            # RESUME: the connection broke after the line was sent; its generation may live on.
            resume = result.outcome is Outcome.RESUME
            deps.metrics.requests.labels("retried").inc()
            # Refusals (a rate limit, a full queue, no engine) wait their turn
            # without using up tries: a busy fleet is what a batch waits out.
            failures += result.pace is not Pace.REJECTED
            if failures >= deps.config.max_attempts:
                error = http_error(ApiError(ErrorKind.UNAVAILABLE, f"gave up after {attempt} tries: "
                                                f"{result.message}", code="batch_request_failed"))
                await self._record(line, Result(Outcome.DONE, result.pace, response_line(
                    line.custom_id, request_id, error.status, error.body)))
                return
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 30.0)

    async def _send(self, line: LineRecord, attempt: Attempt, number: int, key_id: str) -> Result:
        """One send of the line (attempt `number`), claimed first. A send cut
        off here (the run stopped mid-send) may still reach a gateway and be
        admitted until its admit-by time, so the lease is not given up
        before then (`sends_cut_until`, read by the runner's release)."""
        admit_by = await self._claim(line, number, attempt.request_id)
        try:
            result = await self._deps.executor.run(dataclasses.replace(attempt, admit_by_unix=admit_by), key_id)
        except asyncio.CancelledError:
            self.sends_cut_until = max(self.sends_cut_until, admit_by + self._deps.config.admit_margin_seconds)
            raise
        if result.outcome is Outcome.FENCED:
            raise LostLease   # the gateway saw our lease run out first: nothing was admitted
        return result

    async def _claim(self, line: LineRecord, attempt: int, request_id: str) -> float:
        """Claim the line for one send (resumes too; ownership.py): its
        admit-by time. LostLease when the lease is gone -- or too close to
        its end for a gateway to admit the send (a renewal running late: the
        line stays open and the runner's next poll picks the batch up again)."""
        deps = self._deps
        expires = await deps.db.run(deps.db.store.claim_line, self.lease, line.line, attempt, request_id)
        if expires is None:
            raise LostLease
        admit_by = expires - deps.config.admit_margin_seconds
        if deps.clock.wall() >= admit_by:
            raise LostLease
        return admit_by

    async def _record(self, line: LineRecord, result: Result) -> None:
        deps = self._deps
        if not await deps.db.run(deps.db.store.record_result, self.lease, line.line, result.output, result.ok,
                                 result.tokens):
            raise LostLease
        deps.metrics.requests.labels("ok" if result.ok else "error").inc()
        deps.metrics.tokens.inc(result.tokens)

    async def _finalize(self, final: str) -> None:
        db, now = self._deps.db, int(self._deps.clock.wall())
        if final == "completed":
            moved = await db.run(db.store.update_batch, None, self.lease.batch_id, ("in_progress", "finalizing"),
                                 {"status": "finalizing", "finalizing_at": now}, self.lease)
            if moved is None:
                return  # cancelled meanwhile (the runner sees it next poll), or no longer ours
        outputs = await db.run(db.store.outputs, self.lease.batch_id)
        files = await asyncio.to_thread(files_of, outputs, final)  # up to max_lines lines: off the event loop
        done = await db.run(db.store.finish, self.lease, self._tenant, {"status": final, f"{final}_at": now},
                            files, now)
        if done is not None:
            log.info("batch %s %s: %d lines", self.lease.batch_id, final, len(outputs))

