"""A sim mesh under mixed load, watched by a real Prometheus: the run behind
`kvmesh dashboards demo` (the PNGs in artifacts/dashboards/) and the
Prometheus end-to-end test.

The load: streamed chats from P0, P1 and P2 at once over a shared prompt
prefix (prefix-cache hits), batches small enough that requests queue, age and
get preempted for P0; now and then a request the gateway refuses (bad key,
bad body, unknown model, bad X-Priority); an engine SIGKILLed under its
streams (they migrate) and started again; the scheduler SIGKILLed and started
again (gateways re-admit; the restart alert fires).
"""

from __future__ import annotations

import asyncio
import random
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from services.bench.timed_stream import ChatCall, chat_stream
from services.common.config import MeshConfig
from services.launcher.mesh import Mesh, MeshOptions, start_on_free_ports
from services.observability.local_prometheus import LocalPrometheus, mesh_targets
from services.observability.render import RULES_FILE
from services.observability.snapshot import snapshot_boards

__all__ = ["LoadTally", "run_demo", "run_scenario", "tune_for_demo"]

ROOT = Path(__file__).resolve().parents[2]
_PREFIX = ("You are the operator's assistant for a fleet of inference engines. Answer briefly, "
           "in plain words, and say which engine you would look at first. ") * 3
_PRIORITY_WEIGHTS = {0: 0.25, 1: 0.4, 2: 0.35}
_BAD = ("bad_key", "bad_body", "unknown_model", "bad_priority")


@dataclass
class LoadTally:
    """What the clients saw: answers by HTTP status, and the faults made."""

    statuses: Counter[int] = field(default_factory=Counter)
    by_priority: Counter[int] = field(default_factory=Counter)
    failed_streams: int = 0
    stream_errors: Counter[str] = field(default_factory=Counter)  # what the failed streams said
    faults: list[str] = field(default_factory=list)


def tune_for_demo(config: MeshConfig) -> None:
    """Small batches and short bounds, so a minute of load shows queues,
    aging, preemption, refusals (the tenant's queue cap: 429, and a P0
    displacing a queued P2) and heartbeats on two cores."""
    t = config.engines.template
    t.max_running = 3
    t.sim.speed_factor = 1.0
    config.scheduler.engine_queue_slack = 1
    config.scheduler.p0_reserved_leases = 0
    config.scheduler.tenant_queue_cap = 3
    config.scheduler.aging.p1_seconds = 2.0
    config.scheduler.aging.p2_seconds = 2.0
    config.gateway.heartbeat_seconds = 1.0


async def _bad_request(session: aiohttp.ClientSession, base: str, key: str, model: str, kind: str) -> int:
    headers = {"Authorization": f"Bearer {key}"}
    body: dict[str, object] = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    if kind == "bad_key":
        headers["Authorization"] = "Bearer not-a-key"
    elif kind == "bad_body":
        body["max_tokens"] = -5
    elif kind == "unknown_model":
        body["model"] = "no-such-model"
    else:
        headers["X-Priority"] = "9"
    async with session.post(f"{base}/v1/chat/completions", json=body, headers=headers) as resp:
        await resp.read()
        return resp.status


async def _worker(mesh: Mesh, seed: int, until: float, tally: LoadTally) -> None:
    rng = random.Random(seed)
    base, model = mesh.endpoints.public_http, mesh.config.engines.template.model
    async with aiohttp.ClientSession() as session:
        n = 0
        while time.monotonic() < until:
            n += 1
            if n % 6 == 0:
                tally.statuses[await _bad_request(session, base, mesh.api_key, model, rng.choice(_BAD))] += 1
                continue
            priority = rng.choices(list(_PRIORITY_WEIGHTS), list(_PRIORITY_WEIGHTS.values()))[0]
            tokens = rng.choice((16, 48, 96, 160)) if priority else rng.choice((8, 24))
            call = ChatCall(base, mesh.api_key, model, f"{_PREFIX}Question {seed}-{n}: what is slow?",
                            tokens, priority, timeout_seconds=120)
            stream = await chat_stream(session, call)
            tally.statuses[stream.status] += 1
            tally.by_priority[priority] += 1
            if stream.status == 200 and not stream.ok:
                tally.failed_streams += 1
                tally.stream_errors[stream.error_code or stream.error[:120] or f"finish={stream.finish_reason}"] += 1
            if stream.status == 429:  # a client backs off, as Retry-After asks
                await asyncio.sleep(0.5 + rng.random())


async def _faults(mesh: Mesh, seconds: float, tally: LoadTally) -> None:
    """engine-0 killed at 30% of the run and restarted; the scheduler at 60%."""
    await asyncio.sleep(seconds * 0.3)
    await asyncio.to_thread(mesh.kill, "engine-0")
    tally.faults.append("engine-0 killed")
    await asyncio.sleep(2.0)
    await asyncio.to_thread(mesh.restart, "engine-0")
    tally.faults.append("engine-0 restarted")
    await asyncio.sleep(max(0.0, seconds * 0.3 - 2.0))
    await asyncio.to_thread(mesh.kill, "scheduler")
    tally.faults.append("scheduler killed")
    await asyncio.to_thread(mesh.restart, "scheduler")
    tally.faults.append("scheduler restarted")


async def run_scenario(mesh: Mesh, seconds: float, workers: int = 12, faults: bool = True) -> LoadTally:
    """Mixed load for `seconds` (and the faults, unless `faults` is False)."""
    tally = LoadTally()
    until = time.monotonic() + seconds
    jobs = [_worker(mesh, seed, until, tally) for seed in range(workers)]
    if faults:
        jobs.append(_faults(mesh, seconds, tally))
    await asyncio.gather(*jobs)
    return tally


def start_demo_mesh(config: MeshConfig, run_dir: Path) -> Mesh:
    """Scheduler, two sim engines, one gateway and Envoy on free ports."""
    tune_for_demo(config)
    options = MeshOptions(engines=2, backend="sim", gateways=1, model="tiny-llama", free_ports=True, run_dir=run_dir)
    return start_on_free_ports(config, options)


def run_demo(config: MeshConfig, out_dir: Path, seconds: float = 150.0) -> list[Path]:
    """Mesh + Prometheus + load, then one PNG per board of the whole run."""
    with tempfile.TemporaryDirectory(prefix="kvmesh-demo-") as tmp:
        mesh = start_demo_mesh(config, Path(tmp) / "mesh")
        try:
            with LocalPrometheus(mesh_targets(mesh), [ROOT / RULES_FILE], Path(tmp) / "prometheus") as prom:
                prom.wait_all_up()
                began = time.time()
                tally = asyncio.run(run_scenario(mesh, seconds))
                time.sleep(5.0)  # the last scrapes and rule evaluations
                print(f"load: {dict(tally.statuses)} by class {dict(tally.by_priority)}; "
                      f"{tally.failed_streams} streams failed {dict(tally.stream_errors)}; "
                      f"faults: {', '.join(tally.faults)}")
                return snapshot_boards(prom.url, out_dir, minutes=(time.time() - began + 10) / 60,
                                       rate_interval="15s")
        finally:
            mesh.stop_all()
