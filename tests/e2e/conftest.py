"""The real-vLLM meshes several e2e test modules share (a vLLM engine's boot
is most of a vLLM test's time; _vllm_mesh.SharedVllmMesh):

- `shared_tiny_one`: one tiny-llama engine running 2 sequences -- a whole
  vLLM batch in a few requests (test_e2e_vllm.py, test_e2e_vllm_preemption.py,
  which differ in scheduler settings only: the scheduler restarts between),
  tracing to TINY_ONE_TRACE_PORT, where test_e2e_vllm_tracing.py listens
  while it runs (no receiver otherwise: spans are dropped, serving never
  waits for an export);
- `shared_tiny_pair`: two tiny-llama engines, 8 sequences each, the hang
  floor low (HANG_FLOOR_SECONDS) -- engine faults and migration
  (test_e2e_vllm_core_kill.py, test_e2e_vllm_migration.py);
- `shared_smol_pair`: two SmolLM2-135M-Instruct engines -- the agent API
  (agent_api/) and a structured stream's migration
  (test_e2e_vllm_structured_migration.py).

A module takes the mesh with `<holder>.get(tmp_path_factory)` in a module
(or package) fixture: a health check, and a repair (or a fresh mesh) where
an earlier module left it broken. So a module run alone (`-k`) gets a mesh
of its own as before, and order never decides a result. It does decide the
cost: the modules of one mesh run one after another (the collection hook
below), and a mesh is stopped once the next test does not use it.

Also here: `LongStreamRun`, test_e2e_long_stream.py's two minutes of
waiting, run in the background from collection on (_long_stream.py).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _vllm_mesh import TINY_ONE_TRACE_PORT, SharedVllmMesh

from services.common.config import MeshConfig

AGENT_MODEL = "SmolLM2-135M-Instruct"
# The hang bound of the tiny pair (30 s by default): its steps are ~0.1 s,
# so the bound is the floor, and the two SIGSTOP tests of
# test_e2e_vllm_core_kill.py wait it out. Not lower: with another vLLM mesh
# running on the same 2 cores, a fresh engine's first batch took 6 s
# without an output (5 s here declared that engine hung, before the engine
# told a starved backend from a hung one: services/engine/slow_or_hung.py
# now gives a busy one 4 x the bound). Back at 20 s: in a fresh-clone run a
# just-restarted engine held its first 3 requests 12.2 s without an output
# while its processes sat at 0% of a core ("blocked"), and 10 s declared it
# hung (the next module's streams then ran without it). Why a fresh vLLM
# core blocks that long is not known yet; 20 s was the floor of every CI
# run that passed.
HANG_FLOOR_SECONDS = 20.0


def _tiny_one(config: MeshConfig) -> None:
    config.engines.template.vllm.max_num_seqs = 2
    config.tracing.otlp_endpoint = f"http://127.0.0.1:{TINY_ONE_TRACE_PORT}"


def _tiny_pair(config: MeshConfig) -> None:
    config.engines.template.vllm.max_num_seqs = 8
    config.engines.template.hang_floor_seconds = HANG_FLOOR_SECONDS
    # The engine's own fault handling is what these modules test: a stopped
    # core's streams must wait for the engine's hang bound, not move on the
    # gateways' stall deadlines (seconds) first. The deadlines run on the
    # other vLLM meshes.
    config.deadlines.enabled = False


def _smol_pair(config: MeshConfig) -> None:
    config.engines.template.vllm.kv_cache_gib = 0.5  # the 8192-token context needs 0.35 GiB
    # A test SIGKILLs one engine; on a loaded shared 2-core machine (every
    # vLLM pinned to one core) a 30 s stall of the OTHER one was taken for a
    # hang and restarted it too, leaving no engine. The engine now tells
    # such a stall from a hang (services/engine/slow_or_hung.py: its threads
    # wait for a core); the floor stays as a margin -- no test of this mesh
    # tests the hang bound.
    config.engines.template.hang_floor_seconds = 180.0
    # The structured-migration test's 4 JSON streams run through a wait for
    # every stream's 40th chunk, a kill and a re-prefill on the survivor; on
    # a loaded CI machine one ran past the default 120 s generation bound.
    # No test of this mesh tests that bound.
    config.gateway.max_generation_seconds = 300.0
    # Its migration test kills one engine and asserts every stream ends on
    # the other. The gateways' stall deadlines (seconds, from the measured
    # p95) would first move streams off an engine that merely waits for a
    # core -- a fresh-clone run beside the sim lane of `make test` moved
    # three off a 4.6 s stall of engine-0, 5 s before engine-1 was killed,
    # and with both excluded they waited for engine-1's restart past the
    # 120 s bound. No test of this mesh tests the deadlines (the tiny
    # one-engine mesh does); a stall followed by a death within the
    # exclusion window is RELIABILITY.md's open case.
    config.deadlines.enabled = False


SHARED = {
    "shared_tiny_one": SharedVllmMesh("tiny-vllm-one", engines=1, tune=_tiny_one),
    "shared_tiny_pair": SharedVllmMesh("tiny-vllm-pair", engines=2, tune=_tiny_pair),
    "shared_smol_pair": SharedVllmMesh("smol-vllm-pair", engines=2, tune=_smol_pair, model=AGENT_MODEL),
}


@pytest.fixture(scope="session")
def shared_tiny_one() -> Iterator[SharedVllmMesh]:
    yield SHARED["shared_tiny_one"]
    SHARED["shared_tiny_one"].close()


@pytest.fixture(scope="session")
def shared_tiny_pair() -> Iterator[SharedVllmMesh]:
    yield SHARED["shared_tiny_pair"]
    SHARED["shared_tiny_pair"].close()


@pytest.fixture(scope="session")
def shared_smol_pair() -> Iterator[SharedVllmMesh]:
    yield SHARED["shared_smol_pair"]
    SHARED["shared_smol_pair"].close()


class LongStreamRun:
    """test_e2e_long_stream.py's two-minute run (_long_stream.py) in a
    process of its own, started once the test is collected: it waits on
    the clock, not the CPU, so it runs beside the tests before it. The
    test reads its result (`result`), waiting for it if it is still on."""

    SCRIPT = Path(__file__).with_name("_long_stream.py")

    def __init__(self) -> None:
        self._proc: subprocess.Popen[str] | None = None
        self._dir: Path | None = None

    def start(self) -> None:
        if self._proc is None:
            self._dir = Path(tempfile.mkdtemp(prefix="kvmesh-long-stream-"))
            with (self._dir / "run.log").open("w") as log:
                self._proc = subprocess.Popen([sys.executable, str(self.SCRIPT), str(self._dir / "mesh")],
                                              stdout=subprocess.PIPE, stderr=log, text=True,
                                              cwd=self.SCRIPT.parents[2])

    def result(self, timeout: float = 600.0) -> dict[str, Any]:
        self.start()
        assert self._proc is not None and self._dir is not None
        out, _ = self._proc.communicate(timeout=timeout)
        lines = out.strip().splitlines()
        log = (self._dir / "run.log").read_text(errors="replace")[-3000:]
        assert self._proc.returncode == 0 and lines, f"the long-stream run failed ({self._dir}):\n{log}"
        shutil.rmtree(self._dir, ignore_errors=True)  # kept (the mesh's logs) only when the run failed
        return dict(json.loads(lines[-1]))

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()  # the script stops its mesh on SIGTERM
            try:
                self._proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self._proc.kill()


LONG_STREAM = LongStreamRun()


@pytest.fixture(scope="session")
def long_stream_run() -> LongStreamRun:
    return LONG_STREAM


def pytest_collection_finish(session: pytest.Session) -> None:
    if not session.config.option.collectonly and any(
            item.path.name == "test_e2e_long_stream.py" for item in session.items):
        LONG_STREAM.start()


def _mesh_of(item: pytest.Item) -> str | None:
    return next((name for name in SHARED if name in item.fixturenames), None)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Last, after `-m` / `-k` deselected what the run does not select: a
    plan made before that booted every shared vLLM mesh in the background
    of a `-m 'not vllm'` run, whose tests never used them (a lane of
    `make test` held three idle vLLM meshes, 9 GiB).

    The modules of one shared mesh run one after another (between two of
    its users the mesh would be stopped and booted again), and the shared
    meshes' groups run after every other e2e module, in the order their
    first modules stand: so each boots in the background while those other
    modules run (PrestartPlan). Every other module keeps its place."""
    modules: dict[Path, list[pytest.Item]] = {}
    for item in items:
        modules.setdefault(item.path, []).append(item)
    users = {path: next((name for item in its if (name := _mesh_of(item)) is not None), None)
             for path, its in modules.items()}
    ordered = [item for path, its in modules.items() if users[path] is None for item in its]
    for name in dict.fromkeys(name for name in users.values() if name is not None):
        ordered += [item for path, its in modules.items() if users[path] == name for item in its]
    items[:] = ordered
    PLAN.plan(ordered)


class PrestartPlan:
    """When each shared mesh is needed (its first and last user in the
    run's order), so that (a) one is stopped after its last user, and (b)
    the next ones boot in the background ahead of their first user, one at
    a time, during tests that use no shared mesh -- once the mesh before
    them is stopped, so no two vLLM meshes serve tests at once. The
    sim-mesh modules between the groups mostly wait on the clock (streams,
    drains, deadlines), so a boot there costs them little and saves the
    boot's minute before the group."""

    def __init__(self) -> None:
        self.index: dict[str, int] = {}  # item nodeid -> position
        self.first: dict[str, int] = {}  # shared mesh -> its first user's position
        self.last: dict[str, int] = {}

    def plan(self, items: list[pytest.Item]) -> None:
        for position, item in enumerate(items):
            self.index[item.nodeid] = position
            name = _mesh_of(item)
            if name is not None:
                self.first.setdefault(name, position)
                self.last[name] = position

    def done_with(self, position: int) -> list[str]:
        """The shared meshes no test from `position + 1` on uses."""
        return [name for name in SHARED if self.last.get(name, -1) <= position]

    def to_boot(self, position: int) -> str | None:
        """The shared mesh to boot now, before the test at `position`, if any."""
        if any(shared.booting for shared in SHARED.values()):
            return None
        if any(SHARED[name].running and self.first[name] <= position for name in self.first):
            return None  # a group is being served (or is between its users)
        ahead = sorted((first, name) for name, first in self.first.items()
                       if first > position and not SHARED[name].running)
        return ahead[0][1] if ahead else None


PLAN = PrestartPlan()


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Boot the next shared mesh in the background (PrestartPlan)."""
    position = PLAN.index.get(item.nodeid)
    if position is None or _mesh_of(item) is not None or item.config.option.collectonly:
        return
    name = PLAN.to_boot(position)
    if name is not None:
        # pytest's own factory, as its tmp_path_factory fixture returns it.
        factory: pytest.TempPathFactory = item.config._tmp_path_factory
        SHARED[name].prestart(factory)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """After a test's own teardown: a shared mesh no later test uses is
    stopped now, not at the end of the session."""
    yield
    position = PLAN.index.get(item.nodeid)
    done = list(SHARED) if nextitem is None or position is None else PLAN.done_with(position)
    for name in done:
        if SHARED[name].running or SHARED[name].booting:
            SHARED[name].close()


def pytest_sessionfinish(session: pytest.Session) -> None:
    for shared in SHARED.values():
        shared.close()
    LONG_STREAM.stop()
