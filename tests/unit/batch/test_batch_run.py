"""A batch's run on one gateway (services/batch/batch_run.py) with
a scripted line executor and a real database: a dead owner's running line
is resumed first and rerun only when its generation is gone, retriable
failures are retried up to `max_attempts`, cancellation accounts for every
line, and a run that lost its lease writes nothing more."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from services.batch.batch_run import BatchRun, RunDeps
from services.batch.callers import Callers
from services.batch.gate import Gate
from services.batch.metrics import BatchMetrics
from services.batch.output import response_line
from services.batch.pacing import Pace, Window
from services.batch.runner import BatchRunner
from services.batch.store import Database
from services.batch.submit import Attempt, Outcome, Result
from services.common.clock import FakeClock
from services.common.config import GatewayConfig, MeshConfig
from services.common.config.batch import BatchConfig
from services.gateway.keys import ANONYMOUS

TTL = 6.0
Script = Callable[[Attempt], Result]


def ok(attempt: Attempt) -> Result:
    return Result(Outcome.DONE, Pace.PLACED, response_line(attempt.custom_id, attempt.request_id, 200, {}), True, 4)


class FakeExecutor:
    def __init__(self, script: Script) -> None:
        self.script = script
        self.attempts: list[Attempt] = []
        self.release = asyncio.Event()
        self.release.set()

    async def run(self, attempt: Attempt, key_id: str) -> Result:
        self.attempts.append(attempt)
        await self.release.wait()
        return self.script(attempt)


async def _attempts(executor: FakeExecutor, n: int) -> None:
    """Until the executor has been called `n` times (bounded: a hang fails)."""
    async with asyncio.timeout(10):
        while len(executor.attempts) < n:
            await asyncio.sleep(0.01)


@pytest.fixture
def db(tmp_path: Path) -> Iterator[Database]:
    database = Database(str(tmp_path / "b.sqlite3"))
    yield database
    database.close()


def _setup(db: Database, n: int, script: Script, max_attempts: int = 3) -> tuple[RunDeps, FakeExecutor]:
    lines: list[tuple[str, str, str | None]] = [
        (f"c{i}", json.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}]}), None)
        for i in range(n)]
    clock = FakeClock()
    now = int(clock.wall())
    batch = {"id": "batch_t", "object": "batch", "endpoint": "/v1/chat/completions", "status": "in_progress",
             "created_at": now, "expires_at": now + 86400, "input_file_id": "file-x", "completion_window": "24h"}
    db.store.create_batch("tenant", "key", batch, lines)
    executor = FakeExecutor(script)
    deps = RunDeps(BatchConfig(max_attempts=max_attempts), db, executor, Gate(Window(4), clock),  # type: ignore[arg-type]  # a scripted executor
                   BatchMetrics(CollectorRegistry()), clock)
    return deps, executor


def _run(deps: RunDeps, owner: str, now: float) -> BatchRun:
    lease = deps.db.store.claim("batch_t", owner, now, TTL)
    assert lease is not None
    batch = deps.db.store.get_batch(None, "batch_t")
    assert batch is not None
    return BatchRun(deps, lease, batch, "tenant", ANONYMOUS)


def _file_lines(db: Database, field: str) -> list[dict]:
    batch = db.store.get_batch("tenant", "batch_t")
    assert batch is not None
    content = db.store.file_content("tenant", batch[field]) if batch.get(field) else b""
    return [json.loads(x) for x in (content or b"").splitlines()]


async def test_a_dead_owners_running_line_is_resumed_then_rerun_only_if_gone(db: Database) -> None:
    def script(attempt: Attempt) -> Result:
        if attempt.resume and attempt.custom_id == "c1":
            return Result(Outcome.RERUN, Pace.NEUTRAL)   # its generation was gone
        return ok(attempt)
    deps, executor = _setup(db, 3, script)
    dead = db.store.claim("batch_t", "gw-dead", deps.clock.wall(), TTL)
    assert dead is not None
    assert db.store.mark_running(dead, 1, 1, "batch_t-1-1") and db.store.mark_running(dead, 2, 1, "batch_t-2-1")
    run = _run(deps, "gw-new", deps.clock.wall() + TTL + 1)
    await run.run()
    tried = sorted((a.custom_id, a.request_id, a.resume) for a in executor.attempts)
    assert tried == [("c0", "batch_t-1-1", True), ("c1", "batch_t-2-1", True), ("c1", "batch_t-2-2", False),
                     ("c2", "batch_t-3-1", False)]
    batch = db.store.get_batch("tenant", "batch_t")
    assert batch is not None and batch["status"] == "completed" and batch["completed_at"] is not None
    assert batch["request_counts"] == {"total": 3, "completed": 3, "failed": 0}
    assert sorted(o["custom_id"] for o in _file_lines(db, "output_file_id")) == ["c0", "c1", "c2"]
    assert batch.get("error_file_id") is None
    counted = deps.metrics.registry.get_sample_value
    assert counted("kvmesh_batch_requests_total", {"result": "resumed"}) == 1
    assert counted("kvmesh_batch_requests_total", {"result": "rerun"}) == 1


async def test_retriable_failures_are_retried_then_reported(db: Database, monkeypatch: pytest.MonkeyPatch) -> None:
    async def no_sleep(_seconds: float) -> None:
        return None
    monkeypatch.setattr("services.batch.batch_run.asyncio.sleep", no_sleep)
    failures = {"c0": 1, "c1": 99}
    refusals = {"c0": 4, "c1": 0}

    def script(attempt: Attempt) -> Result:
        if refusals[attempt.custom_id] > 0:  # waited out: uses no try
            refusals[attempt.custom_id] -= 1
            return Result(Outcome.RETRY, Pace.REJECTED, message="queue full")
        if failures[attempt.custom_id] > 0:
            failures[attempt.custom_id] -= 1
            return Result(Outcome.RETRY, Pace.NEUTRAL, message="engines failed")
        return ok(attempt)
    deps, executor = _setup(db, 2, script, max_attempts=3)
    await _run(deps, "gw", deps.clock.wall()).run()
    assert sorted(a.request_id for a in executor.attempts) == sorted(
        [f"batch_t-1-{i}" for i in range(1, 7)] + ["batch_t-2-1", "batch_t-2-2", "batch_t-2-3"])
    errors = _file_lines(db, "error_file_id")
    assert [(e["custom_id"], e["response"]["status_code"]) for e in errors] == [("c1", 503)]
    assert "engines failed" in errors[0]["response"]["body"]["error"]["message"]
    assert [o["custom_id"] for o in _file_lines(db, "output_file_id")] == ["c0"]


async def test_cancel_accounts_for_every_line(db: Database) -> None:
    deps, executor = _setup(db, 10, ok)
    executor.release.clear()   # lines hang in flight until cancelled
    run = _run(deps, "gw", deps.clock.wall())
    task = asyncio.create_task(run.run())
    await _attempts(executor, 4)   # the gate's window: 4 in flight
    run.stop("cancelled")
    await asyncio.wait_for(task, 10)
    batch = db.store.get_batch("tenant", "batch_t")
    assert batch is not None and batch["status"] == "cancelled" and batch["cancelled_at"] is not None
    errors = _file_lines(db, "error_file_id")
    assert sorted(e["custom_id"] for e in errors) == sorted(f"c{i}" for i in range(10))
    assert {e["error"]["code"] for e in errors} == {"batch_cancelled"}
    assert deps.gate.in_flight == 0


async def test_a_run_that_lost_its_lease_writes_nothing(db: Database) -> None:
    deps, executor = _setup(db, 2, ok)
    executor.release.clear()
    run = _run(deps, "gw-old", deps.clock.wall())
    task = asyncio.create_task(run.run())
    await _attempts(executor, 2)
    assert await db.run(db.store.claim, "batch_t", "gw-new", deps.clock.wall() + TTL + 1, TTL) is not None  # taken over
    executor.release.set()
    await asyncio.wait_for(task, 10)
    batch = db.store.get_batch("tenant", "batch_t")
    assert batch is not None and batch["status"] == "in_progress"
    assert batch["request_counts"]["completed"] == 0
    assert [ln.state for ln in db.store.open_lines("batch_t", 0, 10)] == ["running", "running"]


def _runner(deps: RunDeps, owner: str) -> BatchRunner:
    return BatchRunner(deps, Callers(MeshConfig(gateway=GatewayConfig(auth_enabled=False))), owner)


async def _settle(runner: BatchRunner) -> None:
    """Let the runs the runner started finish."""
    await asyncio.gather(*(task for _, task in runner._owned.values()))


async def test_a_silent_owner_is_taken_over_after_its_lease(db: Database) -> None:
    deps, executor = _setup(db, 3, ok)
    executor.release.clear()
    clock = deps.clock
    assert isinstance(clock, FakeClock)
    # Two gateways: one database, a gate each.
    first, second = _runner(deps, "gw-a"), _runner(dataclasses.replace(deps, gate=Gate(Window(4), clock)), "gw-b")
    await first._tick()
    await second._tick()
    assert list(first._owned) == ["batch_t"] and not second._owned
    await _attempts(executor, 3)
    # gw-a falls silent (no more ticks); within the lease gw-b waits, after it takes over.
    clock.advance(TTL - 1)
    await second._tick()
    assert not second._owned
    clock.advance(2)
    await second._tick()
    await _attempts(executor, 6)  # gw-b resumes the three lines gw-a still runs
    executor.release.set()
    await _settle(second)
    await _settle(first)   # its late results were refused by the fence
    batch = db.store.get_batch("tenant", "batch_t")
    assert batch is not None and batch["status"] == "completed"
    assert sorted(o["custom_id"] for o in _file_lines(db, "output_file_id")) == ["c0", "c1", "c2"]
    resumed = [a for a in executor.attempts[3:] if a.resume]
    assert len(resumed) == 3, executor.attempts  # the new owner resumed all three under their ids
    await first.stop()
    await second.stop()


async def test_expiry_ends_a_batch(db: Database) -> None:
    deps, executor = _setup(db, 2, ok)
    executor.release.clear()
    clock = deps.clock
    assert isinstance(clock, FakeClock)
    runner = _runner(deps, "gw")
    await runner._tick()
    clock.advance(86401)
    await runner._tick()
    await _settle(runner)
    batch = db.store.get_batch("tenant", "batch_t")
    assert batch is not None and batch["status"] == "expired" and batch["expired_at"] is not None
    assert {e["error"]["code"] for e in _file_lines(db, "error_file_id")} == {"batch_expired"}
    await runner.stop()


async def test_cancelling_reaches_the_owner_at_its_next_poll(db: Database) -> None:
    deps, executor = _setup(db, 6, ok)
    executor.release.clear()
    runner = _runner(deps, "gw")
    await runner._tick()
    await _attempts(executor, 4)
    assert await db.run(db.store.update_batch, "tenant", "batch_t", ("in_progress",), {"status": "cancelling"})
    await runner._tick()
    await _settle(runner)
    batch = db.store.get_batch("tenant", "batch_t")
    assert batch is not None and batch["status"] == "cancelled"
    assert len(_file_lines(db, "error_file_id")) == 6
    await runner.stop()


async def test_a_draining_gateway_finishes_its_lines_and_hands_the_batch_over(db: Database) -> None:
    deps, executor = _setup(db, 6, ok)
    executor.release.clear()
    runner = _runner(deps, "gw-a")
    await runner._tick()
    await _attempts(executor, 4)
    deps.gate.close()                # the drain: no new lines
    executor.release.set()
    await _settle(runner)
    await runner._tick()             # its run ended: the lease goes
    assert not runner._owned
    counts = (await db.run(db.store.get_batch, "tenant", "batch_t") or {})["request_counts"]
    assert counts["completed"] == 4  # the lines in flight finished here
    assert await db.run(db.store.claim, "batch_t", "gw-b", deps.clock.wall(), TTL) is not None  # at once
    await runner.stop()


async def test_the_gate_bounds_lines_and_close_wakes_its_waiters() -> None:
    clock = FakeClock()
    gate = Gate(Window(limit_max=2, limit=2.0), clock)
    assert await gate.acquire() and await gate.acquire()
    waiter = asyncio.create_task(gate.acquire())
    await asyncio.sleep(0.01)
    assert not waiter.done()          # full: waits for a release
    gate.release()
    assert await asyncio.wait_for(waiter, 5) and gate.in_flight == 2
    third = asyncio.create_task(gate.acquire())
    await asyncio.sleep(0.01)
    gate.close()
    assert await asyncio.wait_for(third, 5) is False and gate.in_flight == 2


async def test_a_taken_over_owner_sends_no_line_again(db: Database) -> None:
    """A stale-but-alive owner (taken over while a send of its was out)
    sends nothing more: its next send -- here the resume after a broken
    connection, which used to go out without any write -- is claimed under
    its lease first, and that claim fails (ownership.py)."""
    calls = 0

    def script(attempt: Attempt) -> Result:
        nonlocal calls
        calls += 1
        return Result(Outcome.RESUME, Pace.NEUTRAL, message="cut") if calls == 1 else ok(attempt)
    deps, executor = _setup(db, 1, script)
    executor.release.clear()
    run = _run(deps, "gw-old", deps.clock.wall())
    task = asyncio.create_task(run.run())
    await _attempts(executor, 1)
    assert await db.run(db.store.claim, "batch_t", "gw-new", deps.clock.wall() + TTL + 1, TTL) is not None
    executor.release.set()
    await asyncio.wait_for(task, 10)
    assert [(a.request_id, a.resume) for a in executor.attempts] == [("batch_t-1-1", False)]
    [line] = db.store.open_lines("batch_t", 0, 10)
    assert (line.state, line.request_id, line.epoch) == ("running", "batch_t-1-1", 1)   # the new owner resumes it


async def test_every_send_carries_its_claims_admit_by_time(db: Database) -> None:
    """What a gateway admits only before (the lease's expiry as claimed, less
    batch.admit_margin_seconds), on new attempts and resumes alike."""
    deps, executor = _setup(db, 2, ok)
    dead = db.store.claim("batch_t", "gw-dead", deps.clock.wall(), TTL)
    assert dead is not None and db.store.mark_running(dead, 1, 1, "batch_t-1-1")
    run = _run(deps, "gw-new", deps.clock.wall() + TTL + 1)
    await run.run()
    expected = run.lease.expires_at - deps.config.admit_margin_seconds
    assert sorted((a.resume, a.admit_by_unix) for a in executor.attempts) == [(False, expected), (True, expected)]


async def test_a_lease_too_close_to_its_end_sends_nothing(db: Database) -> None:
    """A renewal running late: no gateway would admit the send in time, so
    it is not sent; the line stays open for the runner's next poll."""
    deps, executor = _setup(db, 1, ok)
    run = _run(deps, "gw", deps.clock.wall())
    clock = deps.clock
    assert isinstance(clock, FakeClock)
    clock.advance(TTL - deps.config.admit_margin_seconds)
    await run.run()
    assert executor.attempts == []
    assert [ln.state for ln in db.store.open_lines("batch_t", 0, 10)] == ["running"]


async def test_a_stop_that_cuts_a_send_keeps_the_lease_while_that_send_could_be_admitted(db: Database) -> None:
    """A clean stop hands the batch over at once -- unless it cut a send
    off mid-way: that send may still reach a gateway and be admitted until
    its admit-by time, so the next owner takes over only after it (and then
    resumes the line rather than running it a second time)."""
    deps, executor = _setup(db, 2, ok)
    executor.release.clear()
    clock = deps.clock
    runner = _runner(deps, "gw-a")
    await runner._tick()
    await _attempts(executor, 2)          # two sends out, unanswered
    await runner.stop()
    assert await db.run(db.store.claim, "batch_t", "gw-b", clock.wall(), TTL) is None
    assert await db.run(db.store.claim, "batch_t", "gw-b", clock.wall() + TTL, TTL) is not None
