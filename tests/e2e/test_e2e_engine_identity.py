"""A rescheduled engine rejoins at once (engine incarnations,
services/scheduler/engine_registry.py), on a real mesh (scheduler, two sim
engines, gateway, Envoy: processes on free ports).

engine-0 runs streams and is SIGSTOPped: its TCP connections stay open and
no keepalive has fired yet -- a pod on a node cut off, as far as its peers
can tell. A second process with the SAME id starts on another port,
announcing a DNS name (`localhost:<port>`), as a StatefulSet pod rescheduled
elsewhere would. It is registered and placed on at once, well before any
keepalive (the scheduler's superseded counter proves the old registration
was still there). The old process's streams complete through migration with
nothing lost (compared with an uninterrupted run). SIGCONT: the old process
learns it was superseded, ends what it held and exits (code 3) instead of
re-registering; the scheduler keeps the new one.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import yaml
from _streams import eventually, gateway_counter, run_streams, scheduler_state
from test_e2e_reliability import _assert_same, _engine, _expected, _finish, _prompts

from services.common.config import MeshConfig
from services.common.service_main import EXIT_SERVICE_FAILED
from services.launcher.mesh import Mesh

ROOT = Path(__file__).resolve().parents[2]
STREAMS = 12
TOKENS = 600
VICTIM = "engine-0"


def MESH_TUNE(config: MeshConfig) -> None:  # noqa: N802 - the fixture's hook name
    # Keepalive far above a process start-up on a loaded machine, so "before
    # any keepalive" is unambiguous; the hang detector stays out (it would
    # fire once the stopped engine runs again).
    config.network.keepalive_time_seconds = 20.0
    config.network.keepalive_timeout_seconds = 10.0
    config.engines.template.hang_floor_seconds = 300.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _metric(port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def _start_successor(mesh: Mesh, run_dir: Path) -> tuple[subprocess.Popen[bytes], str, int]:
    """engine-0 again, a new process on new ports, announcing a DNS name."""
    port, metrics_port = _free_port(), _free_port()
    data = yaml.safe_load(Path(mesh.config_path).read_text())
    engines = data.setdefault("engines", {})
    engines.update(count=1, base_port=port, metrics_base_port=metrics_port, http_base_port=0)
    address = f"localhost:{port}"
    engines.setdefault("template", {})["advertise_address"] = address
    config_path = run_dir / "successor.yaml"
    config_path.write_text(yaml.safe_dump(data))
    log = (run_dir / "successor.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "--config", str(config_path), "engine", "--index", "0"],
        cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return proc, address, metrics_port


def _stop(process: subprocess.Popen[bytes] | None) -> None:
    """End the successor this test started, by its PID (bounded)."""
    if process is None or process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(10)


def _registered_at(mesh: Mesh, address: str) -> bool:
    state = scheduler_state(mesh)
    engine = None if state is None else _engine(state, VICTIM)
    return engine is not None and engine.address == address and engine.fresh and engine.serving


async def test_a_rescheduled_engine_rejoins_at_once_and_the_old_process_is_fenced(
    e2e_mesh: Mesh, tmp_path: Path,
) -> None:
    mesh = e2e_mesh
    bound = mesh.config.network.detect_seconds
    prompts, lengths = _prompts("identity", STREAMS), [TOKENS] * STREAMS
    later = _prompts("identity-later", 6)
    expected = await _expected(mesh, prompts, lengths)
    superseded = _metric(mesh.config.scheduler.metrics_port, "kvmesh_scheduler_engines_superseded_total")
    migrations = gateway_counter(mesh, "kvmesh_gateway_migrations_total")
    pid = mesh.pid(VICTIM)
    assert pid is not None

    results, tasks, session = await run_streams(mesh, prompts, lengths)
    successor = None
    try:
        await eventually(lambda: sum(r.chunks >= 3 and not r.done for r in results) >= STREAMS // 2, 60,
                         "half the streams to be mid-answer")
        os.kill(pid, signal.SIGSTOP)
        stopped_at = time.monotonic()
        successor, address, successor_metrics = _start_successor(mesh, tmp_path)
        await eventually(lambda: _registered_at(mesh, address), bound, f"{VICTIM} at {address}")
        rejoined = time.monotonic() - stopped_at
        # It superseded the old registration, which keepalive had not ended.
        assert _metric(mesh.config.scheduler.metrics_port,
                       "kvmesh_scheduler_engines_superseded_total") == superseded + 1
        assert rejoined < bound, f"rejoined after {rejoined:.1f}s: keepalive bound {bound:.0f}s"

        # Placed on at once: new streams run there (the old process is frozen).
        # Prompts no engine has seen: run for the reference only afterwards, so no
        # cached prefix draws them to the surviving engine.
        _, later_tasks, later_session = await run_streams(mesh, later, [200] * len(later))
        later_results = await _finish(later_tasks, later_session)
        served = _metric(successor_metrics, "vllm:request_success_total")
        assert served >= 1, "nothing was placed on the new process"
        # (At the sim's own speed: the stopped process cannot be told another.)
        expected_later = await _expected(mesh, later, [200] * len(later), unthrottled=False)
        _assert_same(later_results, expected_later)

        # The old process's streams migrate (the gateway's keepalive) and complete exactly.
        _assert_same(await _finish(tasks, session), expected)
        moved = gateway_counter(mesh, "kvmesh_gateway_migrations_total") - migrations
        assert moved >= 1
        completed = time.monotonic() - stopped_at
    except BaseException:
        _stop(successor)  # the second block's `finally` is never reached
        raise
    finally:
        os.kill(pid, signal.SIGCONT)
    try:
        # Healed: it learns it was superseded, hands over what it held, exits.
        code = await asyncio.to_thread(mesh.wait, VICTIM, 30.0)
        assert code == EXIT_SERVICE_FAILED, f"old {VICTIM} exit: {code}\n{mesh.log_tail(VICTIM, 30)}"
        assert "superseded by a newer process" in mesh.log_tail(VICTIM, 400)
        assert _registered_at(mesh, address), "the old process came back over the new one"
        # Every request now runs on the successor and engine-1, exactly.
        _, again_tasks, again_session = await run_streams(mesh, later, [200] * len(later))
        _assert_same(await _finish(again_tasks, again_session), expected_later)
        print(f"{VICTIM} rescheduled (old SIGSTOPped, {STREAMS} streams): the new process at {address} "
              f"registered {rejoined:.1f}s after the stop (keepalive bound {bound:.0f}s), served {served:.0f} "
              f"new requests; {moved:.0f} streams migrated, all exact, {completed:.1f}s stop -> last token; "
              f"the old process exited {code} after SIGCONT")
    finally:
        _stop(successor)
