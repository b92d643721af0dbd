"""A dead engine is dead, a hung one is detected: SIGKILL of one vLLM
engine's `VLLM::EngineCore` process, then of its `VLLM::Worker` (the model
runner: on CPU vLLM always uses its multiprocess executor, one worker
process under the core), then SIGSTOP of the core and SIGCONT once its
streams moved -- what a GPU fault, an OOM kill, a crashed or a wedged
kernel look like -- while greedy streams run, the engine service alive.
A killed process's death is logged by the engine within 2 s (it watches
its vLLM processes itself) and none of the engine's vLLM processes outlives
it (an orphaned worker would keep a core, or a GPU's memory).

Every stream completes with text identical to an uninterrupted greedy run
(the engine ends its streams UNAVAILABLE and the gateway migrates them, no
`finish_reason: error`); from the fault until the engine is back the
scheduler's view of it only goes down (serving false or gone, leases never
rise, reach 0) and requests sent meanwhile all run on the other engine; the
engine process exits with code 3 and the launcher's supervision loop -- the
one `kvmesh up` runs -- restarts it with the same id and port, and it
serves again (the same greedy tokens as the surviving engine; requests
through the gateway are placed on it and complete). SIGSTOP: no
output while the engine holds streams, declared hung past its bound (the
floor: 20 s on the shared pair), then the same as a kill; the core continued (SIGCONT)
after the hang was declared delivers nothing (no text twice), the engine
still exits and comes back.

Three tests on the tiny-llama pair the run shares with
test_e2e_vllm_migration.py (tests/e2e/conftest.py; the hang floor 20 s):
two vLLM engines start in ~1-2 minutes on 2 cores, each faulted one again.
The core is killed on the engine holding the most streams, the worker on
the other one (whatever it holds; a kill of an idle engine still must lose
nothing and bring it back).

By hand, on the SmolLM2 pair (the agent model, as issue 29 asks) and with
either victim for either kill (`most` | `other`):

    KVMESH_KILL_PAIR=smol KVMESH_KILL_VICTIM=other .venv/bin/python -m pytest \
        tests/e2e/test_e2e_vllm_core_kill.py -k sigkill -s
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import signal
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import grpc
import pytest
from _streams import (
    StreamResult,
    all_placed,
    engine_counters,
    gateway_counter,
    run_streams,
    scheduler_state,
    wait_until,
)
from _vllm_mesh import SharedVllmMesh, Supervised

from services.common.affinity import descendants
from services.common.proto.kvmesh.v1 import common_pb2, engine_pb2, engine_pb2_grpc, scheduler_pb2
from services.common.service_main import EXIT_SERVICE_FAILED
from services.engine.liveness import PROBE_EVERY_SECONDS
from services.launcher.mesh import ChildExit, Mesh
from services.launcher.up import Restarts

pytestmark = [pytest.mark.vllm, pytest.mark.e2e, pytest.mark.timeout(2400)]

# Which shared pair the module faults, and whose process both kills hit
# (unset: the core on the engine holding the most, the worker on the other).
PAIR = os.environ.get("KVMESH_KILL_PAIR", "tiny")
VICTIM = os.environ.get("KVMESH_KILL_VICTIM", "")
if PAIR not in ("tiny", "smol") or VICTIM not in ("", "most", "other"):
    raise pytest.UsageError("KVMESH_KILL_PAIR: tiny | smol; KVMESH_KILL_VICTIM: most | other")

STREAMS = 8
MAX_TOKENS = 600  # ~4-6 s of decode here; the fault comes within a second of every stream's third chunk
RESTART_SECONDS = 900.0
# The engine watches its vLLM processes (issue 29: vLLM's client took ~60 s
# to notice) and takes one for dead from its kill, not its exit (SIGKILL
# pending or exiting in /proc, looked at every 0.1 s from a thread:
# vllm_backend/process_watch.py). Waiting for the exit (its pidfd) logged
# the death 0.07-0.30 s after the kill, but once 9.8 s in a fresh-clone
# run: on the loaded 2-core machine a killed worker was seen 10.7 s in the
# kernel freeing its memory (exit_mmap), pinned to the OpenMP core the
# other engine keeps busy. Seen 0.07-0.09 s after either kill now (two
# runs), whatever the teardown takes.
DEATH_SEEN_SECONDS = 2.0
FENCED_TRIES = 3  # direct_generate
# Short enough that SmolLM2 on a loaded 2-core machine ends it well inside
# the fence's two reports (64 tokens took longer, and every try was fenced).
DIRECT_TOKENS = 16
# vLLM 0.32 on CPU, one engine, tensor/pipeline/data parallel 1: the CPU
# platform turns the "uni" executor into the multiprocess one (OpenMP needs
# its own process), so the model runs in one worker process under the core.
# A vLLM that changes this fails here: extend the test to the new process.
VLLM_TREE = ["VLLM::EngineCore", "VLLM::Worker"]


if PAIR == "smol":
    @pytest.fixture(scope="module")
    def supervised(shared_smol_pair: SharedVllmMesh, tmp_path_factory: pytest.TempPathFactory) -> Supervised:
        """The shared SmolLM2 pair (tests/e2e/conftest.py; its hang floor
        is 180 s: only the SIGKILL tests are meant for it), supervised like `kvmesh up`."""
        return shared_smol_pair.get(tmp_path_factory)
else:
    @pytest.fixture(scope="module")
    def supervised(shared_tiny_pair: SharedVllmMesh, tmp_path_factory: pytest.TempPathFactory) -> Supervised:
        """The shared tiny-llama pair (tests/e2e/conftest.py: 8 sequences per
        engine, the hang floor 20 s), supervised like `kvmesh up`."""
        return shared_tiny_pair.get(tmp_path_factory)


def _title(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace").strip()
    except OSError:
        return ""


def vllm_tree(mesh: Mesh, engine_id: str) -> dict[str, int]:
    """The vLLM processes under an engine service, by title, each checked to
    be the only one of its kind and the worker a child of the core."""
    root = mesh.pid(engine_id)
    assert root is not None
    found = {pid: _title(pid) for pid in descendants(root)}
    vllm = {title: pid for pid, title in found.items() if title.startswith("VLLM::")}
    assert sorted(vllm) == sorted(VLLM_TREE) and len(vllm) == len(
        [t for t in found.values() if t.startswith("VLLM::")]), f"{engine_id}: processes under it {found}"
    parent = Path(f"/proc/{vllm['VLLM::Worker']}/stat").read_text().rsplit(")", 1)[1].split()[1]
    assert int(parent) == vllm["VLLM::EngineCore"], f"{engine_id}: the worker is not the core's child: {found}"
    return vllm


def engine_state(state: scheduler_pb2.SchedulerState | None, engine_id: str) -> scheduler_pb2.EngineState | None:
    return None if state is None else next((e for e in state.engines if e.engine_id == engine_id), None)


async def direct_generate(address: str, request_id: str, prompt_ids: list[int], max_tokens: int) -> list[int]:
    """One greedy generation on an engine's own gRPC port; its token ids.
    No scheduler leases it, so lease fencing (services/scheduler/fencing.py)
    ends it UNAVAILABLE "fenced" should it outlive two load reports
    `fencing.confirm_seconds` (1 s) apart -- a slow step on a loaded
    machine; such a run is tried again (a new id), up to FENCED_TRIES."""
    for attempt in range(FENCED_TRIES):
        try:
            return await _direct_once(address, f"{request_id}-{attempt}", prompt_ids, max_tokens)
        except grpc.aio.AioRpcError as exc:
            if exc.code() is not grpc.StatusCode.UNAVAILABLE or "fenced" not in (exc.details() or "") \
                    or attempt == FENCED_TRIES - 1:
                raise
    raise AssertionError("unreachable")


async def _direct_once(address: str, request_id: str, prompt_ids: list[int], max_tokens: int) -> list[int]:
    async with grpc.aio.insecure_channel(address) as channel:
        call = engine_pb2_grpc.EngineStub(channel).Generate()
        await call.write(engine_pb2.EngineGenerateMessage(request=engine_pb2.EngineRequest(
            request_id=request_id, prompt_token_ids=prompt_ids,
            sampling=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0))))
        ids: list[int] = []
        async with asyncio.timeout(120):
            while True:
                event = await call.read()
                assert event is not grpc.aio.EOF, "the stream ended without finished"
                if event.HasField("finished"):
                    assert event.finished.finish_reason == common_pb2.FINISH_REASON_LENGTH, event.finished
                    return ids
                ids += event.delta.token_ids


async def _greedy(mesh: Mesh, prompts: list[str], max_tokens: int) -> list[StreamResult]:
    _, tasks, session = await run_streams(mesh, prompts, [max_tokens] * len(prompts))
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        await session.close()


@dataclass(frozen=True)
class View:
    """The scheduler's view of the faulted engine at `at` s after the fault
    (registered False: it is not in the scheduler's state)."""

    at: float
    registered: bool
    serving: bool
    leases: int


@dataclass
class Views:
    """Polled from the fault until the restarted engine serves."""

    samples: list[View] = field(default_factory=list)

    def dead_part(self) -> list[View]:
        """From the fault to the first sample serving again after it stopped."""
        out: list[View] = []
        stopped = False
        for view in self.samples:
            if stopped and view.serving:
                break
            stopped = stopped or not view.serving
            out.append(view)
        return out

    def stopped_after(self) -> float:
        """Seconds from the fault to the first sample not serving (or gone)."""
        return next(v.at for v in self.samples if not v.serving)


async def watch_views(mesh: Mesh, engine_id: str, began: float, views: Views, stop: asyncio.Event) -> None:
    while not stop.is_set():
        view = engine_state(await asyncio.to_thread(scheduler_state, mesh), engine_id)
        now = time.monotonic() - began
        views.samples.append(View(now, False, False, 0) if view is None
                             else View(now, True, view.serving, view.leases))
        await asyncio.sleep(0.1)


def assert_nothing_placed_while_dead(views: Views, engine_id: str) -> None:
    """Until it serves again, the engine's leases only go down (the streams
    it held leave, nothing new comes) to 0, and it stopped serving."""
    dead = views.dead_part()
    leases = [v.leases for v in dead]
    assert any(not v.serving for v in dead), f"{engine_id} never stopped serving: {dead}"
    assert all(b <= a for a, b in itertools.pairwise(leases)), \
        f"something was placed on {engine_id} while it was dead: {dead}"
    assert leases[-1] == 0, f"{engine_id} still held leases when it came back: {dead}"


@dataclass
class Faulted:
    """One fault under greedy streams: who got it, what the clients saw."""

    victim: str
    survivor: str
    old_pid: int
    target: int  # the signalled process
    baseline: list[StreamResult]
    elapsed: float  # fault -> last token
    moved: float    # migrations
    views: Views
    stop_views: asyncio.Event
    watcher: asyncio.Task[None]
    tree: dict[str, int] = field(default_factory=dict)  # the victim's vLLM processes, by title
    wall: float = 0.0  # time.time() of the fault (the engine's log has wall-clock times)
    held: int = 0  # streams the victim held at the fault


async def fault_mid_stream(mesh: Mesh, sig: signal.Signals, title: str,
                           meanwhile: Callable[[Faulted], Coroutine[Any, Any, None]] | None = None,
                           victim_rule: str = "most") -> Faulted:
    """Greedy streams placed (on one engine or both: placement decides), mid-answer; `sig` to the
    vLLM process `title` of the engine holding the most (`victim_rule` "other": of the
    other one, however few it holds); every stream must
    complete with the text of the uninterrupted run. `meanwhile` runs
    alongside the streams after the fault. Prompts new to the mesh: a
    restarted engine's cache is empty, and prompts the other one holds
    would all be placed there. The scheduler's view of the victim is
    polled from the fault on, until the caller stops it."""
    prompts = [f"{sig.name} {title} stream {i}: the quick brown fox jumps over the lazy dog, and then"
               for i in range(STREAMS)]
    baseline = await _greedy(mesh, prompts, MAX_TOKENS)
    assert all(r.ok for r in baseline), [r.error for r in baseline if not r.ok]
    migrations = gateway_counter(mesh, "kvmesh_gateway_migrations_total")
    results, tasks, session = await run_streams(mesh, prompts, [MAX_TOKENS] * STREAMS)
    try:
        await wait_until(lambda: all_placed(mesh, STREAMS), 120, "every stream placed, both engines serving")
        await wait_until(lambda: all(r.chunks >= 3 for r in results), 120, "every stream to be mid-answer")
        state = scheduler_state(mesh)
        assert state is not None
        most = max(state.engines, key=lambda e: (e.leases, e.engine_id)).engine_id
        other = next(e.engine_id for e in state.engines if e.engine_id != most)
        victim, survivor = (most, other) if victim_rule == "most" else (other, most)
        held = next(e.leases for e in state.engines if e.engine_id == victim)
        old_pid = mesh.pid(victim)
        assert old_pid is not None
        tree = vllm_tree(mesh, victim)
        target = tree[title]
        assert sum(r.done for r in results) < STREAMS
        views, stop_views = Views(), asyncio.Event()
        began, wall = time.monotonic(), time.time()
        os.kill(target, sig)  # the engine service itself lives on
        fault = Faulted(victim, survivor, old_pid, target, baseline, 0.0, 0.0, views, stop_views,
                        asyncio.create_task(watch_views(mesh, victim, began, views, stop_views)), tree, wall)
        extra = [asyncio.create_task(meanwhile(fault))] if meanwhile is not None else []
        results = list(await asyncio.gather(*tasks))
        fault.elapsed = time.monotonic() - began
        await asyncio.gather(*extra)
    finally:
        await session.close()
    failed = [(i, r.status, r.finish_reason, r.error) for i, r in enumerate(results) if not r.ok]
    assert not failed, failed
    for i, (got, want) in enumerate(zip(results, baseline, strict=True)):
        assert got.text == want.text, f"stream {i}: the migrated text differs from the uninterrupted greedy run"
    fault.moved = gateway_counter(mesh, "kvmesh_gateway_migrations_total") - migrations
    fault.held = held
    assert fault.moved >= min(1, held)
    return fault


def hang_wait(mesh: Mesh) -> float:
    """How long to wait for a hang to be declared: the engines' hang bound
    follows their recent step intervals (services/engine/liveness.py), so on a
    starved machine it is far past the floor -- 147 s was seen with the two
    cores shared by other runs -- and a fixed wait would fail the test for the
    machine's slowness, not the engine's."""
    return max(120.0, 2 * max(engine_counters(mesh, "kvmesh_engine_hang_bound_seconds")) + 30.0)


async def exit_of(restarts: Restarts, name: str, seen: int, timeout: float = 120) -> ChildExit:
    """The first exit of `name` among the supervisor's exits after the first `seen`."""
    def exited() -> ChildExit | None:
        return next((e for e in restarts.exits[seen:] if e.name == name), None)
    await wait_until(lambda: exited() is not None, timeout, f"{name}'s process to exit")
    gone = exited()
    assert gone is not None
    assert gone.returncode == EXIT_SERVICE_FAILED, f"{name} exited {gone.returncode}; see {gone.log_path}"
    return gone


async def requests_meanwhile(mesh: Mesh, restarts: Restarts, victim: str, restarted: int) -> bool:
    """A few requests while the victim is down: all served (by the other
    engine: the polled view shows nothing placed on the victim). False if
    it was back before they could be sent."""
    if victim in restarts.restarted[restarted:]:
        return False
    prompts = [f"Meanwhile {i}: the quick brown fox" for i in range(4)]
    meanwhile = await _greedy(mesh, prompts, 40)
    assert all(r.ok for r in meanwhile), [r.error for r in meanwhile if not r.ok]
    return True


async def placed_on(mesh: Mesh, engine_id: str, tag: str) -> int:
    """Requests through the gateway while both engines are idle: the
    scheduler places some on `engine_id` and every one completes. Returns
    the most leases it held at once."""
    prompts = [f"After the restart {tag} {i}: the quick brown fox" for i in range(6)]
    _, tasks, session = await run_streams(mesh, prompts, [60] * len(prompts))
    held = 0
    try:
        while not all(t.done() for t in tasks):
            view = engine_state(await asyncio.to_thread(scheduler_state, mesh), engine_id)
            held = max(held, view.leases if view is not None else 0)
            await asyncio.sleep(0.1)
        results = [t.result() for t in tasks]
    finally:
        await session.close()
    assert all(r.ok for r in results), [r.error for r in results if not r.ok]
    assert held > 0, f"nothing was placed on the restarted {engine_id}"
    return held


async def back_and_serving(mesh: Mesh, restarts: Restarts, fault: Faulted, restarts_before: int) -> float:
    """Restarted by the supervision loop (same id, same port), registered,
    generating the survivor's greedy tokens straight on its gRPC port, and
    placed on again by the scheduler. Stops the view watch; nothing was placed on the victim until then.
    Returns seconds from the fault to serving again."""
    victim = fault.victim

    def back() -> bool:
        view = engine_state(scheduler_state(mesh), victim)
        return restarts.restarted.count(victim) > restarts_before and view is not None and view.serving \
            and view.fresh
    await wait_until(back, RESTART_SECONDS, f"{victim} to be restarted and serving", poll=0.1)
    await asyncio.sleep(0.3)  # a sample or two of the view serving again
    fault.stop_views.set()
    await fault.watcher
    back_after = fault.views.samples[-1].at
    assert_nothing_placed_while_dead(fault.views, victim)
    assert mesh.pid(victim) != fault.old_pid
    state = scheduler_state(mesh)
    addresses = {e.engine_id: e.address for e in state.engines} if state is not None else {}
    prompt_ids = [100 + (i * 37) % 5000 for i in range(48)]
    tag = f"{victim}-{restarts_before}"
    again = await direct_generate(addresses[victim], f"after-restart-{tag}", prompt_ids, DIRECT_TOKENS)
    assert len(again) == DIRECT_TOKENS
    assert again == await direct_generate(addresses[fault.survivor], f"survivor-{tag}", prompt_ids, DIRECT_TOKENS)
    vllm_tree(mesh, victim)  # the restarted engine has its core and worker again
    await placed_on(mesh, victim, tag)
    return back_after


def death_seen_after(log: str, fault: Faulted, title: str) -> float:
    """Seconds from the kill to the engine's process watch logging the
    death (vllm_backend/process_watch.py); at most DEATH_SEEN_SECONDS."""
    marker = f"died (pid {fault.target}, {title})"
    line = next((line for line in log.splitlines() if marker in line), None)
    assert line is not None, f"the engine never logged {marker!r}"
    seen = datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp() - fault.wall
    assert seen <= DEATH_SEEN_SECONDS, f"the death was seen {seen:.2f} s after the kill: {line}"
    return seen


def ended(pid: int) -> bool:
    stat = Path(f"/proc/{pid}/stat")
    try:
        return stat.read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


async def _killed_and_restarted(supervised: Supervised, title: str, victim_rule: str) -> str:
    mesh, restarts = supervised.mesh, supervised.restarts
    seen, restarted = len(restarts.exits), len(restarts.restarted)
    counts = {name: restarts.restarted.count(name) for name in mesh.names}
    fault = await fault_mid_stream(mesh, signal.SIGKILL, title, victim_rule=victim_rule)
    victim = fault.victim
    # Dead: the process exited 3 (the supervisor saw it); until it is back
    # the scheduler places nothing on it.
    gone = await exit_of(restarts, victim, seen)
    noticed = death_seen_after(gone.log_path.read_text(errors="replace"), fault, title)
    # No vLLM process outlives its engine (an orphaned worker keeps a core, a GPU's memory).
    await wait_until(lambda: all(ended(pid) for pid in fault.tree.values()), 5,
                     f"{victim}'s vLLM processes {fault.tree} to end with it", poll=0.1)
    sent = await requests_meanwhile(mesh, restarts, victim, restarted)
    back_after = await back_and_serving(mesh, restarts, fault, counts[victim])
    which = "the engine holding the most" if victim_rule == "most" else "the other engine"
    return (f"vLLM {title} SIGKILL on {victim}, {which} ({fault.held} of {STREAMS} streams; "
            f"{fault.survivor} survived): death logged {noticed:.2f}s "
            f"after the kill, no vLLM process left; {STREAMS}/{STREAMS} greedy "
            f"streams identical to the uninterrupted run, {fault.moved:.0f} migrated, {fault.elapsed:.1f}s "
            f"from kill to last token; the scheduler saw it not serving {fault.views.stopped_after():.1f}s "
            f"after the kill; {victim} exited {gone.returncode}, nothing placed on it while down"
            f"{' (4 requests sent meanwhile ran on the other)' if sent else ''}; restarted and serving again "
            f"{back_after:.0f}s after the kill")


async def test_vllm_engine_core_sigkill_migrates_every_stream_and_the_engine_restarts(
        supervised: Supervised) -> None:
    print(await _killed_and_restarted(supervised, "VLLM::EngineCore", VICTIM or "most"))


async def test_vllm_worker_sigkill_is_the_engine_s_death_too(supervised: Supervised) -> None:
    """The worker (the process running the model) killed, its core alive:
    the engine's process watch sees it die and kills the core, the engine
    fails as a whole -- the same as a dead core."""
    print(await _killed_and_restarted(supervised, "VLLM::Worker", VICTIM or "other"))


async def test_vllm_engine_core_sigstop_is_a_hang_detected_within_the_bound(supervised: Supervised) -> None:
    """SIGSTOP of the core (a wedged GPU kernel looks so): no output while the
    engine holds streams; past the hang bound the engine fails like a dead
    one and the streams migrate. SIGCONT as soon as they move: the woken
    core's outputs reach nobody (every text identical, nothing twice), the
    engine still exits and comes back (a hang is the engine's failure: it
    is restarted, not trusted again), and the restart reaps the old core."""
    mesh, restarts = supervised.mesh, supervised.restarts
    seen = len(restarts.exits)
    counts = {name: restarts.restarted.count(name) for name in mesh.names}
    migrations = gateway_counter(mesh, "kvmesh_gateway_migrations_total")
    continued: list[tuple[float, bool]] = []  # (seconds after SIGSTOP, the core was still there)
    patience = [120.0]

    async def sigcont_once_moved(fault: Faulted) -> None:
        began = time.monotonic()
        # The bound as the SIGSTOP left it: the streams' own steps set it.
        patience[0] = await asyncio.to_thread(hang_wait, mesh)

        def moved() -> bool:
            return gateway_counter(mesh, "kvmesh_gateway_migrations_total") > migrations
        await wait_until(moved, patience[0], "the first stream to migrate", poll=0.1)
        alive = True
        try:
            os.kill(fault.target, signal.SIGCONT)
        except ProcessLookupError:
            alive = False
        continued.append((time.monotonic() - began, alive))

    fault = await fault_mid_stream(mesh, signal.SIGSTOP, "VLLM::EngineCore", sigcont_once_moved)
    victim = fault.victim
    gone = await exit_of(restarts, victim, seen, patience[0])
    log = gone.log_path.read_text(errors="replace")
    assert "backend hung: no output for" in log, f"see {gone.log_path}"
    # Detected within the bound (HANG_FLOOR here; k x p99 step if larger)
    # and one check period (<= 1 s), with 2 s for a loaded machine's event
    # loop (21.0 s for a 20.0 s bound seen); the streams' last tokens came
    # after that and the migration.
    detected = log.rsplit("backend hung: no output for ", 1)[1].split(" s", 1)[0]
    bound = log.rsplit("(bound ", 1)[1].split(" s", 1)[0]
    assert float(detected) <= float(bound) + 3.0, (detected, bound)
    assert fault.elapsed >= mesh.config.engine_config(0).hang_floor_seconds - 0.5, fault.elapsed
    back_after = await back_and_serving(mesh, restarts, fault, counts[victim])
    stat = Path(f"/proc/{fault.target}/stat")
    assert not stat.exists() or b" Z " in stat.read_bytes(), "the stopped core outlived its engine"
    # Nothing left running anywhere: no orphaned generation, no lease.
    await wait_until(lambda: (s := scheduler_state(mesh)) is not None and all(e.leases == 0 for e in s.engines)
                     and s.queued_total == 0, 30, "leases and queues to be empty")
    (after, alive), = continued
    print(f"vLLM EngineCore SIGSTOP on {victim}: hang declared after {detected} s without output "
          f"(bound {bound} s), not serving {fault.views.stopped_after():.1f}s after SIGSTOP; "
          f"{STREAMS}/{STREAMS} streams identical, {fault.moved:.0f} migrated, "
          f"{fault.elapsed:.1f}s from SIGSTOP to last token; SIGCONT {after:.1f}s after SIGSTOP "
          f"({'the core continued' if alive else 'the core was already gone'}), no text twice; "
          f"exited {gone.returncode}, restarted and serving again {back_after:.0f}s after SIGSTOP")


async def test_vllm_idle_engine_core_sigstop_is_found_by_the_liveness_probe(supervised: Supervised) -> None:
    """SIGSTOP of an IDLE engine's core (no stream on it: also what is left
    once the gateways' stall deadlines moved a wedged core's streams away):
    no output is owed, so only the liveness probe -- a utility round trip to
    the core -- can find it. The engine fails within the hang bound plus one
    probe period and is restarted; the stopped core is reaped."""
    mesh, restarts = supervised.mesh, supervised.restarts
    state = scheduler_state(mesh)
    assert state is not None and all(e.leases == 0 for e in state.engines)
    victim = state.engines[0].engine_id
    seen, restarted = len(restarts.exits), restarts.restarted.count(victim)
    target = vllm_tree(mesh, victim)["VLLM::EngineCore"]
    # The bound now (no output comes while the core is stopped, so it stays).
    bound = max([mesh.config.engine_config(0).hang_floor_seconds,
                 *engine_counters(mesh, "kvmesh_engine_hang_bound_seconds")])
    patience = hang_wait(mesh)
    began = time.monotonic()
    os.kill(target, signal.SIGSTOP)
    try:
        gone = await exit_of(restarts, victim, seen, patience)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(target, signal.SIGCONT)
    elapsed = time.monotonic() - began
    log = gone.log_path.read_text(errors="replace")
    assert "no answer to a liveness probe" in log, f"see {gone.log_path}"
    floor = mesh.config.engine_config(0).hang_floor_seconds
    assert floor - 0.5 <= elapsed <= bound + PROBE_EVERY_SECONDS + 30.0, (elapsed, bound)

    def back() -> bool:
        view = engine_state(scheduler_state(mesh), victim)
        return restarts.restarted.count(victim) > restarted and view is not None and view.serving and view.fresh
    await wait_until(back, RESTART_SECONDS, f"{victim} to be restarted and serving", poll=0.1)
    stat = Path(f"/proc/{target}/stat")
    assert not stat.exists() or b" Z " in stat.read_bytes(), "the stopped core outlived its engine"
    print(f"vLLM EngineCore SIGSTOP while idle on {victim}: engine failed {elapsed:.1f} s later "
          f"(bound {bound:g} s + probe period {PROBE_EVERY_SECONDS:g} s), restarted and serving again")
