"""The soak run: a real redis-server, the chaos run's loopback mesh
(scheduler, 2 sim engines, the batch service, 2 gateways, Envoy; its
response cache and Responses store on that Redis), the uninterrupted answer
to every distinct request, then `minutes` of mixed traffic with the fault
loop on its thread and the resource sampler beside the clients."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import hashlib
import json
import random
import signal
import tempfile
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from scripts.chaoslib.loopback import Chaos, add_gateway_counters, make_mesh
from scripts.chaoslib.outcomes import Job, Tally, Target, baseline, load, make_jobs
from services.common.config import ApiKeyConfig, MeshConfig
from services.common.config.response_cache import ResponseCacheConfig
from services.launcher.mesh import Mesh

from .batches import BatchTally, run_batches
from .faults import FaultPlan, SoakFaults
from .redis_store import RedisProcess, redis_server
from .report import Result, report
from .series import Sampler
from .traffic import (
    PERSON,
    Call,
    baseline_calls,
    baseline_conversation,
    call_worker,
    check_shapes,
    conversation_worker,
    make_calls,
)

__all__ = ["STREAM_KINDS", "run"]

CACHE_KEY = "sk-soak-cache-tenant"
# Responses and cache entries live this long in Redis: past the warm-up its
# data set (and so its RSS) is in steady state, not growing for an hour.
STATE_TTL_SECONDS = 300.0
_STRUCTURED = json.dumps({"response_format": {"type": "json_schema", "json_schema": {
    "name": "person", "schema": PERSON, "strict": True}}})
# Streamed kinds (the chaos clients: resumed with Last-Event-ID when cut):
# name -> (X-Priority, chat, extra body).
STREAM_KINDS: dict[str, tuple[int, bool, str]] = {
    "completions stream P0": (0, False, ""),
    "completions stream P1": (1, False, ""),
    "completions stream P2": (2, False, ""),
    "chat stream P0": (0, True, ""),
    "chat stream P2": (2, True, ""),
    "structured stream P1": (1, True, _STRUCTURED),
}


def tune(redis_url: str) -> Callable[[MeshConfig], None]:
    def apply(config: MeshConfig) -> None:
        # A generous op timeout, as the Redis e2e tests: on two busy cores a
        # slow store must not make a stored response unstored.
        config.gateway.response_cache = ResponseCacheConfig(
            enabled=True, store="redis", redis_url=redis_url, op_timeout_seconds=1.0, connect_timeout_seconds=1.0,
            ttl_seconds=STATE_TTL_SECONDS)
        config.responses.store = "redis"
        config.responses.ttl_seconds = STATE_TTL_SECONDS
        config.gateway.api_keys.append(ApiKeyConfig(sha256=hashlib.sha256(CACHE_KEY.encode()).hexdigest(),
                                                    tenant="soak-cache", response_cache="on"))
        # A killed batch service's batches are taken over within ~3 s of its restart.
        config.batch.lease_seconds = 3.0
        config.batch.poll_seconds = 0.5
    return apply


def _stream_jobs(rng: random.Random, distinct: int) -> dict[str, list[Job]]:
    out = {}
    for name, (priority, chat, extra) in STREAM_KINDS.items():
        # A structured answer gets room for its whole instance (~20 pieces): valid JSON, finish "stop".
        out[name] = [dataclasses.replace(j, prompt=f"{name}: {j.prompt}", priority=priority, chat=chat,
                                         extra_json=extra, max_tokens=64 if extra else j.max_tokens)
                     for j in make_jobs(rng, distinct, 120)]
    return out


def _pids(mesh: Mesh, redis: RedisProcess) -> dict[str, int]:
    pids = {name: pid for name in mesh.names if (pid := mesh.pid(name)) is not None}
    pids["redis"] = redis.process.pid
    return pids


async def _sample(sampler: Sampler, mesh: Mesh, redis: RedisProcess, every: float, stop: asyncio.Event) -> None:
    while not stop.is_set():
        sampler.sample(_pids(mesh, redis))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), every)


@dataclasses.dataclass
class _Clients:
    """What every client is to send, and the answers to check against."""

    jobs: dict[str, list[Job]]
    expected_jobs: dict[Job, str]
    calls: dict[str, list[Call]]
    expected_calls: dict[Call, str]
    conversation: list[str]


async def _baselines(target: Target, rng: random.Random) -> _Clients:
    jobs = _stream_jobs(rng, 10)
    expected = await baseline(target, [j for js in jobs.values() for j in js])
    calls = make_calls(rng, target.model, target.api_key, CACHE_KEY)
    answers = await baseline_calls(target, [c for cs in calls.values() for c in cs])
    check_shapes([expected[j] for j in jobs["structured stream P1"]]
                 + [json.loads(answers[c])[0] for c in calls["structured"]],
                 [answers[c] for c in calls["tools"]])
    return _Clients(jobs, expected, calls, answers, await baseline_conversation(target))


def _clients(target: Target, c: _Clients, rng: random.Random, until: float,
             tallies: dict[str, Tally]) -> list[Coroutine[Any, Any, None]]:
    out: list[Coroutine[Any, Any, None]] = []
    for name, jobs in c.jobs.items():
        out.append(load(target, jobs, c.expected_jobs, random.Random(rng.random()), until, 1, tallies[name]))
    for name, calls in c.calls.items():
        out.append(call_worker(target, calls, c.expected_calls, random.Random(rng.random()), until, tallies[name]))
    for priority in (0, 1):
        out.append(conversation_worker(target, c.conversation, priority, random.Random(rng.random()), until,
                                       tallies[f"responses P{priority}"]))
    return out


async def run(ns: argparse.Namespace) -> int:
    """The soak; its exit status (1 if anything was lost or a slope is over its bound)."""
    rng = random.Random(ns.seed)
    # SIGTERM ends the run like Ctrl-C: the mesh and Redis are torn down (no verdict).
    main = asyncio.current_task()
    if main is not None:
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, main.cancel)
    run_dir = Path(ns.run_dir or tempfile.mkdtemp(prefix="kvmesh-soak-"))
    ns.run_dir, ns.backend = str(run_dir), "sim"
    duration = ns.minutes * 60.0
    with redis_server(run_dir / "redis") as redis:
        mesh, model = make_mesh(ns, tune(redis.url))
        print(f"soak: seed {ns.seed}, {ns.minutes:g} min, a fault every {ns.fault_min:g}-{ns.fault_max:g} s; "
              f"logs in {mesh.log_dir}", flush=True)
        mesh.start()
        try:
            target = Target(mesh.endpoints.public_http, mesh.api_key, model)
            clients = await _baselines(target, rng)
            tallies = {name: Tally() for name in [*clients.jobs, *clients.calls, "responses P0", "responses P1"]}
            faults_tally, batch = Tally(), BatchTally()
            chaos = Chaos(mesh, random.Random(rng.random()), [], ns.hang_seconds, faults_tally)
            faults = SoakFaults(chaos, FaultPlan(random.Random(rng.random()), duration, (ns.fault_min, ns.fault_max)))
            began = time.monotonic()
            until = began + duration
            sampler, stop_sampling = Sampler(began), asyncio.Event()
            print(f"soak: mesh up, baselines taken; {len(tallies)} clients and a batch at a time for "
                  f"{ns.minutes:g} min", flush=True)
            fault_thread = asyncio.create_task(asyncio.to_thread(faults.run, began, until))
            sampling = asyncio.create_task(_sample(sampler, mesh, redis, ns.sample_seconds, stop_sampling))
            try:
                await asyncio.gather(*_clients(target, clients, rng, until, tallies),
                                     run_batches(target, ns.batch_lines, until - min(180.0, duration / 4), batch))
            finally:
                faults.stop.set()
                await fault_thread
                stop_sampling.set()
                await sampling
            took = time.monotonic() - began
            add_gateway_counters(mesh, faults_tally)
        finally:
            mesh.stop_all()
    result = Result(ns=vars(ns), took=took, tallies=tallies, batch=batch, faults=faults_tally,
                    made=faults.made, fault_loop_failed=faults.failed,
                    verdicts=sampler.verdicts(ns.warmup_minutes * 60.0, ns.min_span_minutes * 60.0),
                    series=list(sampler.series.values()))
    return report(result, Path(ns.out) if ns.out else run_dir / "soak-result.json")
