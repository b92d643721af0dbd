"""`kvmesh up --autoscale` on sim engines, the local actuator of the
scheduler's scaling policy:

- 1:4 under a burst: the fleet grows past one engine, and after the burst
  it shrinks back while a trickle of streams keeps running -- every stream
  completes (0 lost while engines leave);
- 0:2: the mesh starts with no engine; the first request waits (heartbeats)
  and completes once an engine has started; none is refused.

Each test runs its own mesh and the supervision loop `kvmesh up` runs
(`supervise`, with the actuator) in a thread."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import aiohttp
import pytest
from _mesh_stop import stop_test_mesh
from _streams import StreamResult, scheduler_state, stream_completion, wait_until

from services.common.config import load_config
from services.launcher.mesh import Mesh, MeshOptions, start_on_free_ports
from services.launcher.up import supervise

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 180.0


@contextmanager
def _autoscaled_mesh(tmp_path: Path, bounds: tuple[int, int]) -> Iterator[Mesh]:
    if not (ROOT / ".models" / "tiny-llama").is_dir():
        pytest.skip(".models/tiny-llama is missing: run `make setup`")
    config = load_config(ROOT / "config" / "kvmesh.yaml")
    t = config.engines.template
    t.sim.speed_factor = 1.0
    t.max_running = 4                      # a burst of tens of streams queues on one engine
    s = config.scheduler.scaling
    s.interval_seconds, s.scale_in_hold_seconds = 1.0, 4.0
    s.fast_rate_seconds, s.slow_rate_seconds = 2.0, 4.0
    s.ttft_targets_seconds = [1.0, 2.0, 5.0]
    config.gateway.heartbeat_seconds = 0.5
    options = MeshOptions(backend="sim", model="tiny-llama", free_ports=True, run_dir=tmp_path / "mesh",
                          autoscale=bounds)
    mesh = start_on_free_ports(config, options)
    stop = threading.Event()
    loop = threading.Thread(target=supervise, args=(mesh, stop), daemon=True)
    loop.start()
    try:
        yield mesh
    finally:
        stop.set()
        loop.join(timeout=30)
        stop_test_mesh(mesh)


def _serving(mesh: Mesh) -> int:
    state = scheduler_state(mesh)
    return 0 if state is None else sum(1 for e in state.engines if e.serving and not e.draining and e.fresh)


def _running_engines(mesh: Mesh) -> int:
    return sum(1 for name in mesh.engine_names() if mesh.is_running(name))


async def _streams(session: aiohttp.ClientSession, mesh: Mesh, n: int, tokens: int) -> list[StreamResult]:
    return await asyncio.gather(*(stream_completion(session, mesh, f"burst {i}: tell me a story", tokens)
                                  for i in range(n)))


async def test_a_burst_grows_the_fleet_and_it_shrinks_after_without_losing_a_stream(tmp_path: Path) -> None:
    with _autoscaled_mesh(tmp_path, (1, 4)) as mesh:
        assert _running_engines(mesh) == 1
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT)) as session:
            burst = asyncio.gather(*(_streams(session, mesh, 12, 150) for _ in range(4)))
            await wait_until(lambda: _serving(mesh) >= 2, TIMEOUT, "a second engine serving")
            results = [r for batch in await burst for r in batch]
            grown = _serving(mesh)
            trickle: list[StreamResult] = []

            async def keep_streaming(lane: int) -> None:
                # Two long streams at a time: one engine is plenty, so the
                # fleet drains down to it while these run, some of them on
                # the engines that leave.
                while _running_engines(mesh) > 1:
                    trickle.append(await stream_completion(session, mesh, f"trickle {lane} {len(trickle)}", 250))

            await asyncio.wait_for(asyncio.gather(keep_streaming(0), keep_streaming(1)), TIMEOUT)
        assert grown >= 2
        assert all(r.ok for r in results), [r for r in results if not r.ok][:3]
        assert trickle and all(r.ok for r in trickle), [r for r in trickle if not r.ok][:3]
        log = (mesh.log_dir / "scheduler.log").read_text()
        assert "rejected" not in log
        state = scheduler_state(mesh)
        assert state is not None
        [scaling] = [m for m in state.scaling if m.model == "tiny-llama"]
        assert scaling.autoscaled and scaling.desired >= 1


async def test_from_zero_the_first_request_completes_once_an_engine_started(tmp_path: Path) -> None:
    with _autoscaled_mesh(tmp_path, (0, 2)) as mesh:
        assert _running_engines(mesh) == 0
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT)) as session:
            first, second = await asyncio.gather(stream_completion(session, mesh, "hello from zero", 16),
                                                 stream_completion(session, mesh, "and another", 16))
        assert first.ok and second.ok, (first, second)
        assert _running_engines(mesh) >= 1
        top = subprocess.run([sys.executable, "-m", "services.cli", "--config", str(mesh.config_path), "top",
                              "--once", "--interval", "0.3"], cwd=ROOT, capture_output=True, text=True,
                             timeout=60, check=False, env={**os.environ, "COLUMNS": "200"})
        assert top.returncode == 0 and "Scaling" in top.stdout and "tiny-llama" in top.stdout, top
        log = (mesh.log_dir / "scheduler.log").read_text()
        assert "rejected" not in log
