"""A backend silent past its hang bound: slow (its processes run or wait to
run) or hung (stopped, or blocked) -- the rule on a fake clock, the /proc
evidence on real processes."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from services.common.clock import FakeClock
from services.engine.backend import BackendActivity
from services.engine.liveness import HangPolicy, LivenessWatch
from services.engine.slow_or_hung import ACTIVITY_WINDOW_SECONDS, SlowOrHung
from services.engine.vllm_backend.proc_activity import runnable_seconds, tree_activity

HANG = "backend hung: no output"


class Tree:
    """A fake backend's processes: `rate` runnable seconds per second."""

    def __init__(self, clock: FakeClock, rate: float) -> None:
        self.clock, self.rate = clock, rate
        self.stopped: str | None = None
        self._at, self._total = clock.monotonic(), 0.0

    def activity(self) -> BackendActivity:
        now = self.clock.monotonic()
        self._total += (now - self._at) * self.rate
        self._at = now
        return BackendActivity(self._total, self.stopped)


def busy_watch(rate: float, floor: float = 10.0, busy_multiple: float = 4.0) -> tuple[
        LivenessWatch, FakeClock, Tree, list[str]]:
    clock = FakeClock()
    tree, failures = Tree(clock, rate), list[str]()
    watch = LivenessWatch(HangPolicy(floor, 10.0, busy_multiple), clock, lambda: 1, lambda: None,
                          failures.append, activity=tree.activity)
    watch.entered()
    return watch, clock, tree, failures


def run_until_failure(watch: LivenessWatch, clock: FakeClock, limit: float) -> float | None:
    """Check every watch period on the fake clock; the silence when it failed."""
    began = clock.monotonic()
    while clock.monotonic() - began <= limit:
        if watch.check() is not None:
            return clock.monotonic() - began
        clock.advance(watch.period)
    return None


def test_a_silent_backend_whose_processes_run_is_slow_not_hung_until_its_ceiling() -> None:
    """The saturated-core case: no output past the 10 s bound, but its threads
    run or queue for a core -- not restarted until 4 x the bound."""
    watch, clock, _, failures = busy_watch(rate=1.3)
    failed_at = run_until_failure(watch, clock, 60.0)
    assert failed_at is not None and 40.0 < failed_at <= 40.0 + 2 * watch.period, failed_at
    assert len(failures) == 1 and "past 4 x the bound (40.0 s) without output" in failures[0]


def test_output_ends_the_silence_a_slow_backend_is_never_failed() -> None:
    watch, clock, _, failures = busy_watch(rate=1.0)
    assert run_until_failure(watch, clock, 25.0) is None
    watch.output(None)                                # a slow step ends: progress
    assert run_until_failure(watch, clock, 25.0) is None
    assert failures == []


def test_a_blocked_backend_is_hung_one_window_after_the_bound() -> None:
    """A deadlock: its threads neither run nor wait for a core."""
    watch, clock, _, failures = busy_watch(rate=0.01)
    failed_at = run_until_failure(watch, clock, 60.0)
    assert failed_at is not None and 10.0 < failed_at <= 10.0 + ACTIVITY_WINDOW_SECONDS + 2 * watch.period
    assert "blocked, not slow" in failures[0]


def test_a_stopped_process_is_hung_at_the_bound_whatever_the_others_do() -> None:
    """SIGSTOP of vLLM's core: its worker may spin waiting for it, but a
    stopped process cannot progress."""
    watch, clock, tree, failures = busy_watch(rate=2.0)
    tree.stopped = "VLLM::EngineCore (pid 7) is stopped (state T)"
    failed_at = run_until_failure(watch, clock, 60.0)
    assert failed_at is not None and 10.0 < failed_at <= 10.0 + 2 * watch.period
    assert failures[0].endswith("; VLLM::EngineCore (pid 7) is stopped (state T)")


def test_a_backend_that_cannot_tell_is_hung_at_the_bound() -> None:
    clock = FakeClock()
    failures: list[str] = []
    watch = LivenessWatch(HangPolicy(10.0, 10.0), clock, lambda: 1, lambda: None, failures.append)
    watch.entered()
    failed_at = run_until_failure(watch, clock, 60.0)
    assert failed_at is not None and 10.0 < failed_at <= 10.0 + 2 * watch.period
    assert failures[0].startswith(HANG) and ";" not in failures[0]


def test_a_busy_multiple_of_one_is_the_bound_alone() -> None:
    watch, clock, _, _ = busy_watch(rate=1.0, busy_multiple=1.0)
    failed_at = run_until_failure(watch, clock, 60.0)
    assert failed_at is not None and failed_at <= 10.0 + 2 * watch.period


async def test_an_unanswered_probe_of_a_busy_idle_backend_waits_for_the_ceiling() -> None:
    """The bench_vllm case: an idle engine's probe unanswered on a core
    another process saturates; its processes wait for the core."""
    clock = FakeClock()
    tree, failures = Tree(clock, 0.5), list[str]()
    never = asyncio.Event()

    async def probe() -> None:
        await never.wait()

    watch = LivenessWatch(HangPolicy(10.0, 10.0, 3.0), clock, lambda: 0, lambda: None, failures.append,
                          probe, tree.activity)
    assert watch.check() is None
    await asyncio.sleep(0)
    failed_at = run_until_failure(watch, clock, 60.0)
    assert failed_at is not None and 30.0 < failed_at <= 30.0 + 2 * watch.period, failed_at
    assert "no answer to a liveness probe" in failures[0] and "past 3 x the bound" in failures[0]


def test_the_judge_needs_a_full_window_before_a_verdict() -> None:
    judge = SlowOrHung(4.0)
    quiet = BackendActivity(5.0)
    assert judge.judge(HANG, 0.0, 10.0, 10.1, quiet) is None          # first sample
    assert judge.judge(HANG, 0.0, 10.0, 11.0, quiet) is None          # 0.9 s: too short to tell
    assert "0% of a core" in (judge.judge(HANG, 0.0, 10.0, 12.2, quiet) or "")
    assert judge.judge(HANG, 20.0, 10.0, 30.5, quiet) is None         # a new silence: sampled afresh


# ---------------------------------------------------------------- the /proc evidence


@pytest.fixture
def children() -> Iterator[dict[str, subprocess.Popen[bytes]]]:
    """A process that computes, one that sleeps, one stopped while computing."""
    spin = [sys.executable, "-c", "while True: pass"]
    # The sleeper says when its start-up is over: a fixed pause was too short
    # for an interpreter's start on a loaded machine (0.25 s of it counted).
    sleep = [sys.executable, "-c", "import time; print('asleep', flush=True); time.sleep(600)"]
    procs = {"busy": subprocess.Popen(spin), "asleep": subprocess.Popen(sleep, stdout=subprocess.PIPE),
             "stopped": subprocess.Popen(spin)}
    os.kill(procs["stopped"].pid, signal.SIGSTOP)
    assert procs["asleep"].stdout is not None and procs["asleep"].stdout.readline() == b"asleep\n"
    try:
        yield procs
    finally:
        for proc in procs.values():
            proc.kill()
            proc.wait()


def test_proc_figures_grow_for_a_running_process_and_stand_still_otherwise(
        children: dict[str, subprocess.Popen[bytes]]) -> None:
    before = {name: runnable_seconds(p.pid) for name, p in children.items()}
    time.sleep(1.0)
    grown = {name: runnable_seconds(p.pid) - before[name] for name, p in children.items()}
    # Running or waiting for a core on a loaded 2-core machine: most of the second.
    assert grown["busy"] >= 0.5, grown
    assert grown["asleep"] < 0.05 and grown["stopped"] < 0.05, grown
    assert tree_activity([(children["busy"].pid, "busy"), (children["asleep"].pid, "asleep")]).stopped is None
    stopped = tree_activity([(p.pid, name) for name, p in children.items()]).stopped
    assert stopped == f"stopped (pid {children['stopped'].pid}) is stopped (state T)"


def test_a_gone_process_counts_nothing() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    assert runnable_seconds(proc.pid) == 0.0
    assert tree_activity([(proc.pid, "gone")]) == BackendActivity(0.0, None)
