"""The scheduler's runtime knobs on a running sim mesh, through the real
`kvmesh admin` command: a wrong token is refused; a paused P2 request waits
(its stream open, heartbeats flowing) while a P0 runs, and completes after
the resume; a policy change shows in GetState and in the placement metrics;
a drained engine gets no new request, and takes work again once undrained."""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import aiohttp
import pytest
from _streams import (
    StreamResult,
    engine_counters,
    gateway_counter,
    scheduler_state,
    stream_completion,
    wait_until,
)

from services.launcher.mesh import Mesh

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 120.0


def MESH_TUNE(config) -> None:  # noqa: N802 - the e2e_mesh fixture's hook
    config.gateway.heartbeat_seconds = 0.5   # heartbeats of a queued stream show within the test


def _admin(mesh: Mesh, *args: str, token_file: Path | None = None) -> subprocess.CompletedProcess[str]:
    token = token_file or mesh.files.admin_token_path
    return subprocess.run(
        [sys.executable, "-m", "services.cli", "--config", str(mesh.config_path), "admin",
         "--token-file", str(token), *args],
        cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)


def _scheduler_metric(mesh: Mesh, name: str, labels: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{mesh.config.scheduler.metrics_port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") and all(part in line for part in labels.split(",")))


def _queued(mesh: Mesh, priority: int) -> int:
    state = scheduler_state(mesh)
    return 0 if state is None else sum(q.queued for q in state.queues if q.priority == priority)


async def _raw_stream(session: aiohttp.ClientSession, mesh: Mesh, priority: int, seen: dict) -> None:
    """One streamed completion at `priority`, recording heartbeats, text,
    the finish reason and [DONE] as they come."""
    body = {"model": mesh.config.engines.template.model, "prompt": "Once upon a time", "max_tokens": 12,
            "stream": True, "temperature": 0}
    headers = {"Authorization": f"Bearer {mesh.api_key}", "X-Priority": str(priority)}
    async with session.post(f"{mesh.endpoints.public_http}/v1/completions", json=body, headers=headers) as resp:
        seen["status"] = resp.status
        async for raw in resp.content:
            line = raw.decode().strip()
            if line.startswith(":"):
                seen["heartbeats"] = seen.get("heartbeats", 0) + 1
            elif line == "data: [DONE]":
                seen["done"] = True
            elif line.startswith("data: "):
                for choice in json.loads(line[6:]).get("choices", ()):
                    seen["text"] = seen.get("text", "") + (choice.get("text") or "")
                    seen["finish"] = choice.get("finish_reason") or seen.get("finish")


def test_a_wrong_or_missing_token_is_refused(e2e_mesh: Mesh, tmp_path: Path) -> None:
    wrong = tmp_path / "token"
    wrong.write_text("not-the-token\n")
    result = _admin(e2e_mesh, "pause", "P2", token_file=wrong)
    assert result.returncode == 1 and "UNAUTHENTICATED" in result.stderr, result
    state = scheduler_state(e2e_mesh)
    assert state is not None and not state.paused_priorities
    log = (e2e_mesh.log_dir / "scheduler.log").read_text()
    assert "admin call refused (UNAUTHENTICATED): pause P2" in log


async def test_paused_p2_waits_while_p0_runs_then_completes(e2e_mesh: Mesh) -> None:
    mesh = e2e_mesh
    paused = _admin(mesh, "pause", "P2")
    assert paused.returncode == 0 and "P2 is paused" in paused.stdout, paused
    assert _scheduler_metric(mesh, "kvmesh_scheduler_admissions_paused", 'priority="P2"') == 1
    seen: dict = {}
    async with aiohttp.ClientSession() as session:
        p2 = asyncio.create_task(_raw_stream(session, mesh, 2, seen))
        try:
            await wait_until(lambda: _queued(mesh, 2) == 1, TIMEOUT, "the P2 request queued")
            p0: dict = {}
            await asyncio.wait_for(_raw_stream(session, mesh, 0, p0), TIMEOUT)
            assert p0.get("done") and p0.get("text"), p0          # P0 ran past the paused P2
            await wait_until(lambda: seen.get("heartbeats", 0) >= 2, TIMEOUT, "heartbeats on the queued P2")
            assert _queued(mesh, 2) == 1 and not seen.get("text") and not p2.done()
            top = subprocess.run([sys.executable, "-m", "services.cli", "--config", str(mesh.config_path), "top",
                                  "--once", "--interval", "0.3"], cwd=ROOT, capture_output=True, text=True,
                                 timeout=60, check=False, env={**os.environ, "COLUMNS": "160"})
            assert top.returncode == 0 and "PAUSED" in top.stdout, top
        finally:
            resumed = _admin(mesh, "resume", "P2")
        assert resumed.returncode == 0 and "P2 is dispatched again" in resumed.stdout, resumed
        await asyncio.wait_for(p2, TIMEOUT)
    assert seen["status"] == 200 and seen.get("done") and seen.get("text"), seen
    assert seen.get("finish") in ("length", "stop")                # the same stream, never broken
    assert _scheduler_metric(mesh, "kvmesh_scheduler_admissions_paused", 'priority="P2"') == 0
    log = (mesh.log_dir / "scheduler.log").read_text()
    assert "admin by kvmesh-up (key " in log and "pause P2 -> P2 is paused" in log


async def _complete(session: aiohttp.ClientSession, mesh: Mesh, n: int) -> None:
    for _ in range(n):
        seen: dict = {}
        await asyncio.wait_for(_raw_stream(session, mesh, 1, seen), TIMEOUT)
        assert seen.get("done"), seen


async def test_policy_change_and_drained_engine(e2e_mesh: Mesh) -> None:
    mesh = e2e_mesh
    result = _admin(mesh, "policy", "no_such_policy")
    assert result.returncode == 1 and "INVALID_ARGUMENT" in result.stderr and "round_robin" in result.stderr
    result = _admin(mesh, "policy", "round_robin")
    assert result.returncode == 0, result
    try:
        state = scheduler_state(mesh)
        assert state is not None and state.policy == "round_robin"
        async with aiohttp.ClientSession() as session:
            await _complete(session, mesh, 2)
            assert _scheduler_metric(mesh, "kvmesh_scheduler_placements_total", 'policy="round_robin"') >= 2

            drained = _admin(mesh, "drain-engine", "engine-0")
            assert drained.returncode == 0 and "engine engine-0 gets no new requests" in drained.stdout, drained
            state = scheduler_state(mesh)
            assert state is not None and list(state.drained_engines) == ["engine-0"]
            assert [e.engine_id for e in state.engines if e.drained_by_admin] == ["engine-0"]
            before = engine_counters(mesh, "vllm:request_success_total")
            await _complete(session, mesh, 4)
            after = engine_counters(mesh, "vllm:request_success_total")
            assert after[0] == before[0] and after[1] == before[1] + 4, (before, after)

            undrained = _admin(mesh, "undrain-engine", "engine-0")
            assert undrained.returncode == 0, undrained
            await _complete(session, mesh, 4)                       # round robin: engine-0 again
            assert engine_counters(mesh, "vllm:request_success_total")[0] > after[0]
    finally:
        _admin(mesh, "undrain-engine", "engine-0")
        _admin(mesh, "policy", mesh.config.scheduler.policy)


async def test_drain_with_move_hands_a_running_stream_to_the_other_engine(e2e_mesh: Mesh) -> None:
    mesh = e2e_mesh
    result = StreamResult()
    migrations = gateway_counter(mesh, "kvmesh_gateway_migrations_total")
    async with aiohttp.ClientSession() as session:
        stream = asyncio.create_task(stream_completion(session, mesh, "A long tale about meshes", 600, result))
        try:
            await asyncio.wait_for(result.first_chunk.wait(), TIMEOUT)
            state = scheduler_state(mesh)
            assert state is not None
            (busy,) = [e.engine_id for e in state.engines if e.leases]
            moved = _admin(mesh, "drain-engine", busy, "--move")
            assert moved.returncode == 0 and "handed over" in moved.stdout, moved
            await asyncio.wait_for(stream, TIMEOUT)
        finally:
            undrained = _admin(mesh, "undrain-engine", busy)
    assert result.ok, result                                     # one unbroken stream for the client
    assert len(result.text) > 0 and undrained.returncode == 0
    assert gateway_counter(mesh, "kvmesh_gateway_migrations_total") >= migrations + 1   # moved, not restarted

    def serving_again() -> bool:
        state = scheduler_state(mesh)
        return state is not None and all(e.serving and not e.draining for e in state.engines)

    await wait_until(serving_again, TIMEOUT, "both engines serving again")


def test_state_shows_the_knobs(e2e_mesh: Mesh) -> None:
    result = _admin(e2e_mesh, "state")
    assert result.returncode == 0 and "policy " in result.stdout and "paused: none" in result.stdout, result


def _tmux(socket: str, *args: str) -> str:
    return subprocess.run(["tmux", "-L", socket, *args], capture_output=True, text=True, timeout=30,
                          check=True).stdout


def _engine_lines(screen: str) -> dict[str, list[str]]:
    return {line.split()[0]: line.split() for line in screen.splitlines() if line.strip().startswith("engine-")}


async def test_top_in_a_real_terminal_shows_the_fleet_and_follows_load(e2e_mesh: Mesh) -> None:
    if shutil.which("tmux") is None:
        pytest.skip("tmux is not installed (the project's setup installs it)")
    mesh = e2e_mesh
    socket, session_name = f"kvmesh-top-test-{os.getpid()}", "top"
    # The size is the terminal's (a COLUMNS the test runner exported would override it).
    command = " ".join(shlex.quote(part) for part in (
        "env", "-u", "COLUMNS", "-u", "LINES", sys.executable, "-m", "services.cli",
        "--config", str(mesh.config_path), "top"))
    _tmux(socket, "new-session", "-d", "-s", session_name, "-x", "160", "-y", "50", "-c", str(ROOT), command)
    screens: list[str] = []

    def screen() -> str:
        screens.append(_tmux(socket, "capture-pane", "-p", "-t", session_name))
        return screens[-1]

    try:
        await wait_until(lambda: {"engine-0", "engine-1"} <= set(_engine_lines(screen()))
                         and "Queues by class" in screens[-1] and "gateway-0" in screens[-1], TIMEOUT,
                         "top showing both engines, the queues and the gateway")
        idle = screens[-1]
        assert " P0 " in idle and " P2 " in idle and "policy" in idle
        async with aiohttp.ClientSession() as session:
            load = [asyncio.create_task(_complete(session, mesh, 6)) for _ in range(4)]

            def busy() -> bool:
                rows = _engine_lines(screen())
                # tokens/s (6th column) above zero on some engine, or a request running on one
                return any(r[5] not in ("0.0", "-") or r[3] != "0" for r in rows.values() if len(r) >= 6)

            try:
                await wait_until(busy, TIMEOUT, "top showing the load")
            finally:
                await asyncio.gather(*load)
        assert screens[-1] != idle
    except BaseException:
        print("last screens:\n" + "\n-----\n".join(screens[-2:]))
        raise
    finally:
        subprocess.run(["tmux", "-L", socket, "kill-session", "-t", session_name], capture_output=True,
                       timeout=30, check=False)
