"""The vLLM process watch on real processes: a tree titled like vLLM's
(`VLLM::EngineCore` with a `VLLM::Worker` under it, titled with bash's
`exec -a`, below this test process), one of them SIGKILLed: the death is
reported within 2 s and the rest of the tree is killed, orphans included;
a PID whose start time differs from the recorded one is never signalled;
the vLLM backend reports the death as its own and leaves no process behind
when it stops. A process is dead from its kill, not its exit (SIGKILL
pending or exiting in /proc, faked here: a real one's window is too short
to catch), and a held event loop does not delay the death."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
import subprocess
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
from test_vllm_adapter import backend

from services.common.affinity import descendants
from services.engine.vllm_backend import process_watch
from services.engine.vllm_backend.proc_state import PF_EXITING, ProcState
from services.engine.vllm_backend.process_watch import (
    Death,
    ProcessWatch,
    VllmProcess,
    kill_process,
    running,
    vllm_descendants,
)

# The core's shell starts the worker in the background, then becomes the core.
_TREE = "(exec -a VLLM::Worker sleep 120) & exec -a VLLM::EngineCore sleep 120"


def _state(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def _title(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()
    except OSError:
        return ""


def _gone(pid: int) -> bool:
    return _state(pid) in (None, "Z", "X")


async def _wait_for(check: object, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if callable(check) and check():
            return True
        await asyncio.sleep(0.02)
    return False


@pytest.fixture
async def tree() -> AsyncIterator[dict[str, VllmProcess]]:
    core = subprocess.Popen(["bash", "-c", _TREE])
    try:
        assert await _wait_for(lambda: len(vllm_descendants(os.getpid())) == 2, 5.0)
        found = {p.title: p for p in vllm_descendants(os.getpid())}
        assert sorted(found) == ["VLLM::EngineCore", "VLLM::Worker"], found
        yield found
    finally:
        for p in vllm_descendants(os.getpid()):
            kill_process(p)
        core.kill()
        core.wait()


@pytest.mark.parametrize("victim", ["VLLM::EngineCore", "VLLM::Worker"])
async def test_a_killed_vllm_process_is_reported_within_2_s_and_the_rest_is_killed(
        tree: dict[str, VllmProcess], victim: str) -> None:
    deaths: list[Death] = []
    watch = ProcessWatch(os.getpid(), deaths.append, poll_seconds=10.0)  # the pidfd alone must see it
    assert sorted(p.title for p in watch.start()) == sorted(tree)
    assert watch.look() is None
    await asyncio.sleep(0.05)  # the poll's first look is done: the next one is 10 s away
    killed_at = time.monotonic()
    os.kill(tree[victim].pid, signal.SIGKILL)
    assert await _wait_for(lambda: watch.death is not None, 2.0), "no death seen within 2 s"
    seen = time.monotonic() - killed_at
    assert deaths == [watch.death] and watch.death is not None
    assert watch.death.process == tree[victim] and watch.death.woken
    survivor = next(p for title, p in tree.items() if title != victim)
    assert watch.death.killed == (survivor.pid,)
    assert await _wait_for(lambda: _gone(survivor.pid), 2.0), f"{survivor} still runs"
    assert f"pid {tree[victim].pid}, {victim}" in watch.death.describe(time.monotonic())
    assert seen < 2.0
    assert await watch.stop() == []  # the survivor was killed once, at the death


async def test_the_poll_sees_a_death_without_pidfds(tree: dict[str, VllmProcess]) -> None:
    watch = ProcessWatch(os.getpid(), poll_seconds=0.1)
    watch.start()
    for fd in watch._pidfds.values():  # no pidfd wake-up: the poll alone
        asyncio.get_running_loop().remove_reader(fd)
    os.kill(tree["VLLM::Worker"].pid, signal.SIGKILL)
    assert await _wait_for(lambda: watch.death is not None, 2.0)
    assert watch.death is not None and not watch.death.woken
    assert "(poll)" in watch.death.describe(time.monotonic())
    assert await _wait_for(lambda: _gone(tree["VLLM::EngineCore"].pid), 2.0)
    await watch.stop()


async def test_a_held_event_loop_does_not_delay_the_death(tree: dict[str, VllmProcess]) -> None:
    """The watch looks from a thread: the death is seen and the rest of the
    tree killed while the event loop is held (a blocking call, a burst of
    work); `on_death` runs on the loop once it is free."""
    calls: list[tuple[Death, int]] = []
    watch = ProcessWatch(os.getpid(), lambda d: calls.append((d, threading.get_ident())), poll_seconds=0.05)
    watch.start()
    killed_at = time.monotonic()
    os.kill(tree["VLLM::Worker"].pid, signal.SIGKILL)
    time.sleep(1.0)  # the event loop held: the case under test
    death = watch.death
    assert death is not None and not death.woken, "the death waited for the event loop"
    assert death.seen - killed_at < 0.5
    assert _gone(tree["VLLM::EngineCore"].pid), "the rest of the tree waited for the event loop"
    assert calls == []
    await asyncio.sleep(0.05)
    assert calls == [(death, threading.get_ident())]
    await watch.stop()


_SIGKILL = 1 << (signal.SIGKILL - 1)


@pytest.mark.parametrize(("how", "dying"), [
    ("SIGKILL pending", lambda s: dataclasses.replace(s, pending=s.pending | _SIGKILL)),
    ("exiting", lambda s: dataclasses.replace(s, flags=s.flags | PF_EXITING)),
])
async def test_a_process_is_dead_from_its_kill_not_from_its_exit(
        tree: dict[str, VllmProcess], monkeypatch: pytest.MonkeyPatch, how: str,
        dying: Callable[[ProcState], ProcState]) -> None:
    """A SIGKILLed process is gone (a zombie, its pidfd readable) only once
    the kernel has torn it down -- seconds for a large one on a loaded
    machine. /proc shows it ending before: here the worker's state says so
    while it still runs."""
    worker, killed = tree["VLLM::Worker"], False
    real = process_watch.read_state

    def read_state(pid: int) -> ProcState | None:
        state = real(pid)
        return dying(state) if killed and pid == worker.pid and state is not None else state
    monkeypatch.setattr(process_watch, "read_state", read_state)
    watch = ProcessWatch(os.getpid(), poll_seconds=0.05)
    watch.start()
    await asyncio.sleep(0.2)
    assert watch.death is None
    killed = True
    assert await _wait_for(lambda: watch.death is not None, 1.0), f"a process {how} was not taken for dead"
    assert watch.death is not None and watch.death.process == worker and not watch.death.woken
    assert watch.death.how == how and f"{worker.title}): {how}, seen within" in watch.death.describe(0.0)
    assert watch.death.killed == (tree["VLLM::EngineCore"].pid,)  # not the dying one again
    assert not _gone(worker.pid)  # seen before its exit
    os.kill(worker.pid, signal.SIGKILL)  # its real end, which stop() waits for
    assert await watch.stop() == []


def _exiting_until(monkeypatch: pytest.MonkeyPatch, pid: int, until: Callable[[], bool]) -> None:
    """/proc shows `pid` in the kernel's exit (its teardown) until `until()`."""
    real = process_watch.read_state

    def read_state(other: int) -> ProcState | None:
        state = real(other)
        if other != pid or state is None or until():
            return state
        return dataclasses.replace(state, state="R", flags=state.flags | PF_EXITING)
    monkeypatch.setattr(process_watch, "read_state", read_state)


async def test_stop_returns_once_the_killed_processes_are_gone(
        tree: dict[str, VllmProcess], monkeypatch: pytest.MonkeyPatch) -> None:
    """A killed process's memory (a GPU's too) is freed as the kernel tears
    it down: the engine exits -- and is restarted -- only after that."""
    watch = ProcessWatch(os.getpid(), poll_seconds=0.05)
    watch.start()
    worker = tree["VLLM::Worker"]
    os.kill(worker.pid, signal.SIGKILL)
    torn_down = time.monotonic() + 0.6
    _exiting_until(monkeypatch, worker.pid, lambda: time.monotonic() >= torn_down)
    assert await _wait_for(lambda: watch.death is not None, 1.0)
    assert watch.death is not None and watch.death.how == "exiting"
    assert await watch.stop() == []
    assert time.monotonic() >= torn_down, "stop() returned while a killed process was still being torn down"


async def test_stop_waits_for_the_teardown_no_longer_than_its_bound(
        tree: dict[str, VllmProcess], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    worker = tree["VLLM::Worker"]
    watch = ProcessWatch(os.getpid(), poll_seconds=0.05, exit_wait_seconds=0.3)
    watch.start()
    os.kill(worker.pid, signal.SIGKILL)
    _exiting_until(monkeypatch, worker.pid, lambda: False)
    began = time.monotonic()
    await watch.stop()
    assert 0.3 <= time.monotonic() - began < 2.0
    assert "still not gone" in caplog.text and f"VLLM::Worker pid {worker.pid}" in caplog.text


async def test_a_stopped_process_is_alive(tree: dict[str, VllmProcess]) -> None:
    watch = ProcessWatch(os.getpid(), poll_seconds=0.05)
    watch.start()
    core = tree["VLLM::EngineCore"].pid
    os.kill(core, signal.SIGSTOP)
    try:
        await asyncio.sleep(0.3)
        assert watch.death is None and running(tree["VLLM::EngineCore"])
    finally:
        os.kill(core, signal.SIGCONT)
    await watch.stop()


async def test_stop_kills_every_vllm_process_left(tree: dict[str, VllmProcess]) -> None:
    watch = ProcessWatch(os.getpid())
    watch.start()
    killed = await watch.stop()
    assert sorted(killed) == sorted(p.pid for p in tree.values())
    for p in tree.values():
        assert await _wait_for(lambda p=p: _gone(p.pid), 2.0), p
    assert watch.death is None


async def test_an_exit_while_vllm_is_being_shut_down_is_no_death(tree: dict[str, VllmProcess]) -> None:
    watch = ProcessWatch(os.getpid(), poll_seconds=0.05)
    watch.start()
    watch.pause()  # the engine stops vLLM itself (SIGTERM reaches its core too)
    os.kill(tree["VLLM::EngineCore"].pid, signal.SIGKILL)
    await asyncio.sleep(0.3)
    assert watch.death is None and watch.look() is None
    assert await watch.stop() == [tree["VLLM::Worker"].pid]  # what vLLM's shutdown left


async def test_a_reused_pid_is_never_signalled() -> None:
    other = subprocess.Popen(["sleep", "30"])
    try:
        ticks = int(Path(f"/proc/{other.pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
        earlier = VllmProcess(other.pid, "VLLM::Worker", ticks - 1)  # the PID's former owner
        assert not running(earlier)
        assert kill_process(earlier) is False
        fd = os.pidfd_open(other.pid)
        try:
            assert kill_process(earlier, fd) is False
        finally:
            os.close(fd)
        await asyncio.sleep(0.1)
        assert other.poll() is None, "a process that only shares the PID was killed"
        assert kill_process(VllmProcess(other.pid, "VLLM::Worker", ticks)) is True
        assert other.wait(timeout=5) == -signal.SIGKILL
    finally:
        other.kill()
        other.wait()


async def test_no_vllm_process_means_nothing_watched() -> None:
    watch = ProcessWatch(os.getpid())
    assert watch.start() == []
    assert watch.look() is None
    assert await watch.stop() == []


async def test_the_backend_reports_its_core_dead_and_stops_with_no_vllm_process_left(
        tree: dict[str, VllmProcess]) -> None:
    b, llm = backend([])
    b._watch = ProcessWatch(os.getpid())
    b._watch.start()
    assert b.dead_reason() is None and not llm.errored
    core = tree["VLLM::EngineCore"]
    os.kill(core.pid, signal.SIGKILL)
    assert await _wait_for(lambda: b.dead_reason() is not None, 2.0), "the backend did not see its core die"
    assert f"vLLM core died (pid {core.pid}, VLLM::EngineCore)" in (b.dead_reason() or "")
    assert await _wait_for(lambda: _gone(tree["VLLM::Worker"].pid), 2.0), "the orphaned worker still runs"
    await b.stop()
    assert llm.shut_down and vllm_descendants(os.getpid()) == []


async def test_a_stopping_backend_kills_what_vllms_shutdown_left(tree: dict[str, VllmProcess]) -> None:
    b, llm = backend([])
    b._watch = ProcessWatch(os.getpid())
    b._watch.start()
    await b.stop()  # the fake's shutdown ends nothing: the watch must
    assert llm.shut_down
    for p in tree.values():
        assert await _wait_for(lambda p=p: _gone(p.pid), 2.0), p


async def test_a_backend_whose_start_failed_leaves_no_vllm_process(tree: dict[str, VllmProcess]) -> None:
    b, _ = backend([])
    assert b._watch is None  # the start failed before the watch began
    await b.stop()
    for p in tree.values():
        assert await _wait_for(lambda p=p: _gone(p.pid), 2.0), p


async def test_a_core_that_exits_in_vllms_shutdown_is_no_death(tree: dict[str, VllmProcess]) -> None:
    b, llm = backend([])
    watch = b._watch = ProcessWatch(os.getpid(), poll_seconds=0.01)
    watch.start()

    def shutdown(timeout: float) -> None:  # vLLM's ends its core, then waits a moment
        os.kill(tree["VLLM::EngineCore"].pid, signal.SIGKILL)
        time.sleep(0.2)
    llm.shutdown = shutdown  # type: ignore[method-assign]  # the fake client's shutdown, replaced per test
    await b.stop()
    assert watch.death is None
    assert await _wait_for(lambda: _gone(tree["VLLM::Worker"].pid), 2.0)


async def test_a_dying_tree_is_let_off_its_pinned_cores(
        tree: dict[str, VllmProcess], monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel frees a killed process's memory on that process's own
    threads: vLLM's are pinned to the busy OpenMP cores, so the victim and
    the rest of its tree get the engine's cores too."""
    released: list[list[int]] = []
    monkeypatch.setattr(process_watch, "release_cores", released.append)
    watch = ProcessWatch(os.getpid(), poll_seconds=0.05)
    watch.start()
    os.kill(tree["VLLM::Worker"].pid, signal.SIGKILL)
    assert await _wait_for(lambda: watch.death is not None, 2.0)
    assert sorted(released) == sorted([[tree["VLLM::EngineCore"].pid], [tree["VLLM::Worker"].pid]])
    await watch.stop()


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one core: nothing to release onto")
def test_release_cores_moves_every_thread_onto_the_engines_cores() -> None:
    ours = os.sched_getaffinity(0)
    pinned = {min(ours)}
    other = subprocess.Popen(["sleep", "30"], preexec_fn=lambda: os.sched_setaffinity(0, pinned))  # noqa: PLW1509 - a plain child
    try:
        assert os.sched_getaffinity(other.pid) == pinned
        assert process_watch.release_cores([other.pid]) == 1
        assert os.sched_getaffinity(other.pid) == ours
        assert process_watch.release_cores([2**22 + 1]) == 0  # no such process: nothing, no error
    finally:
        other.kill()
        other.wait()


# Another engine service's vLLM, as a test process hosting an in-process
# backend beside whole meshes has it: a non-vLLM process with the tree below.
_OTHER_ENGINE = f"bash -c '{_TREE}' & wait"


@pytest.fixture
async def other_engine() -> AsyncIterator[list[int]]:
    """A process titled like an engine service, with a vLLM tree below it."""
    engine = subprocess.Popen(["bash", "-c", _OTHER_ENGINE])
    try:
        def tree_up() -> bool:
            return sum(1 for pid in descendants(engine.pid) if _title(pid).startswith("VLLM::")) == 2
        assert await _wait_for(tree_up, 5.0)
        yield [pid for pid in descendants(engine.pid) if _title(pid).startswith("VLLM::")]
    finally:
        engine.kill()
        for pid in descendants(engine.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        engine.wait()


async def test_another_engines_vllm_is_not_watched_nor_killed(
        tree: dict[str, VllmProcess], other_engine: list[int]) -> None:
    """Regression: the in-process vLLM tests' backend stop SIGKILLed every
    shared mesh's engine core (all below the pytest process); a fresh
    clone's run then waited 2 minutes for their restart."""
    watch = ProcessWatch(os.getpid(), poll_seconds=0.05)
    assert sorted(p.pid for p in watch.start()) == sorted(p.pid for p in tree.values())
    os.kill(other_engine[0], signal.SIGKILL)  # the other engine's core dies: no death of ours
    assert await _wait_for(lambda: _gone(other_engine[0]), 2.0)
    await asyncio.sleep(0.3)
    assert watch.death is None
    await watch.stop()
    assert all(_gone(p.pid) for p in tree.values())
    assert not _gone(other_engine[1]), "stop killed another engine's vLLM process"


async def test_a_backend_leaves_vllm_that_ran_before_its_start_alone(tree: dict[str, VllmProcess]) -> None:
    """What ran under this process before the backend launched vLLM is
    another backend's, also on a failed start's clean-up."""
    b, _ = backend([])
    b._foreign = frozenset((p.pid, p.start_ticks) for p in tree.values())
    await b.stop()
    await asyncio.sleep(0.3)
    assert not any(_gone(p.pid) for p in tree.values())
