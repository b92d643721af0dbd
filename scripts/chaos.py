"""Chaos run: load through Envoy while engines, the scheduler and gateways are
killed and restarted at random. Prints what clients saw; exits 1 if any
request was lost.

    .venv/bin/python scripts/chaos.py --seconds 60 --seed 7

The mesh: scheduler, 2 sim engines, 2 gateways, Envoy -- real processes on
free loopback ports, in a temporary run directory. Faults, one at a time,
chosen with the seeded RNG every few seconds:

- engine: SIGKILL, restarted a moment later (streams migrate mid-answer);
- scheduler: SIGKILL, restarted the way `kvmesh up`'s ALWAYS policy does
  (gateways re-admit queued requests and re-attach running ones);
- gateway: SIGTERM (a rolling restart: it finishes its streams, Envoy
  retries new connections on the other replica), then started again.
  A gateway SIGKILL cuts its clients' TCP streams, which no server-side
  design can hide; clients would have to resend.

Every answer is checked against an uninterrupted answer to the same request
taken before the chaos (the sim's text is deterministic, like greedy
decoding), so a repeated or missing token counts as lost.

Outcomes: completed (200, finish length/stop, [DONE], text as expected);
rejected (an HTTP status with an OpenAI error body, or an SSE error event
before any text: a definite answer the client can act on, by reason);
lost (anything else: a broken or truncated stream, a wrong text, an error
after text, a timeout).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import random
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.bench.sse import SseEvents
from services.common.config import load_config
from services.launcher.mesh import Mesh, MeshOptions

MODEL = "tiny-llama"
REQUEST_TIMEOUT_SECONDS = 120.0


@dataclass
class Tally:
    sent: int = 0
    completed: int = 0
    rejected: collections.Counter[str] = field(default_factory=collections.Counter)
    lost: collections.Counter[str] = field(default_factory=collections.Counter)
    actions: list[str] = field(default_factory=list)
    # Gateway counters (migrations, re-admissions) summed over every gateway life.
    counters: collections.Counter[str] = field(default_factory=collections.Counter)


@dataclass(frozen=True)
class Job:
    prompt: str
    max_tokens: int


async def one_request(session: aiohttp.ClientSession, mesh: Mesh, job: Job) -> tuple[str, str, str]:
    """-> (outcome, reason, text); outcome in completed-candidate "ok",
    "rejected", "lost"."""
    body = {"model": MODEL, "prompt": job.prompt, "max_tokens": job.max_tokens, "stream": True, "temperature": 0}
    text, finish, done = "", None, False
    try:
        async with asyncio.timeout(REQUEST_TIMEOUT_SECONDS):
            async with session.post(f"{mesh.endpoints.public_http}/v1/completions", json=body,
                                    headers={"Authorization": f"Bearer {mesh.api_key}"}) as resp:
                if resp.status != 200:
                    raw = await resp.text()
                    try:
                        error = json.loads(raw)["error"]
                        code, message = error.get("code") or "error", str(error.get("message", ""))
                    except (ValueError, KeyError, TypeError, AttributeError):
                        return "lost", f"http {resp.status} without an error body", ""
                    return "rejected", f"http {resp.status} {code}: {message[:90]}", ""
                events = SseEvents(resp.content)
                async for event in events:
                    if "error" in event:
                        code = event["error"].get("code") or "error"
                        if not text:
                            return ("rejected", f"sse error {code}", "")
                        return ("lost", f"error after text: {code}", text)
                    for choice in event.get("choices", ()):
                        text += choice.get("text") or ""
                        finish = choice.get("finish_reason") or finish
                done = events.done
    except TimeoutError:
        return "lost", "timeout", text
    except (aiohttp.ClientError, ValueError) as exc:
        return "lost", f"{type(exc).__name__}", text
    if not done or finish not in ("length", "stop"):
        return "lost", f"stream ended without a finish (done={done}, finish={finish})", text
    return "ok", finish or "", text


async def baseline(mesh: Mesh, jobs: list[Job]) -> dict[Job, str]:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        answers = await asyncio.gather(*(one_request(session, mesh, j) for j in jobs))
    bad = [(j, a[1]) for j, a in zip(jobs, answers, strict=True) if a[0] != "ok"]
    if bad:
        raise SystemExit(f"chaos: the baseline run failed before any fault: {bad[:3]}")
    return {j: a[2] for j, a in zip(jobs, answers, strict=True)}


async def load(mesh: Mesh, jobs: list[Job], expected: dict[Job, str], rng: random.Random,
               until: float, concurrency: int, tally: Tally) -> None:
    async def worker(seed: int) -> None:
        local = random.Random(seed)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            while time.monotonic() < until:
                job = local.choice(jobs)
                tally.sent += 1
                outcome, reason, text = await one_request(session, mesh, job)
                if outcome == "ok" and text != expected[job]:
                    outcome, reason = "lost", "text differs from the uninterrupted answer"
                if outcome == "ok":
                    tally.completed += 1
                elif outcome == "rejected":
                    tally.rejected[reason] += 1
                    await asyncio.sleep(0.2)  # a client backs off after a refusal
                else:
                    tally.lost[reason] += 1
    await asyncio.gather(*(worker(rng.randrange(2**32)) for _ in range(concurrency)))


def gateway_counters(mesh: Mesh, replicas: list[int]) -> dict[str, float]:
    """Migration / re-admission counters summed over these gateway replicas."""
    out: dict[str, float] = collections.defaultdict(float)
    for r in replicas:
        port = mesh.config.gateway.metrics_port + r
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
                text = resp.read().decode()
        except OSError:
            continue
        for line in text.splitlines():
            if line.startswith(("kvmesh_gateway_migrations_total", "kvmesh_gateway_scheduler_readmissions_total")):
                series, value = line.rsplit(" ", 1)
                out[series] += float(value)
    return out


def chaos(mesh: Mesh, rng: random.Random, until: float, tally: Tally) -> None:
    """One fault at a time (runs in a thread: Mesh is driven from one thread)."""
    engines = [n for n in mesh.names if n.startswith("engine-")]
    gateways = [n for n in mesh.names if n.startswith("gateway-")]
    start = time.monotonic()
    while time.monotonic() < until - 3.0:
        time.sleep(rng.uniform(1.0, 3.0))
        kind = rng.choice(["engine", "engine", "scheduler", "gateway"])
        at = time.monotonic() - start
        if kind == "engine":
            name = rng.choice(engines)
            mesh.kill(name)
            time.sleep(rng.uniform(0.5, 2.0))
            mesh.restart(name)
            tally.actions.append(f"{at:5.1f}s SIGKILL {name}, restarted after {time.monotonic() - start - at:.1f}s")
        elif kind == "scheduler":
            mesh.kill("scheduler")
            time.sleep(rng.uniform(0.0, 1.0))
            mesh.restart("scheduler")
            back = time.monotonic() - start - at
            tally.actions.append(f"{at:5.1f}s SIGKILL scheduler, healthy again after {back:.1f}s")
        else:
            name = rng.choice(gateways)
            # Its counters die with it: keep them.
            for series, value in gateway_counters(mesh, [gateways.index(name)]).items():
                tally.counters[series] += value
            mesh.terminate(name)
            code = mesh.wait(name, timeout=15.0)
            mesh.restart(name)
            tally.actions.append(f"{at:5.1f}s SIGTERM {name} (exit {code}), restarted after "
                                 f"{time.monotonic() - start - at:.1f}s")


async def main_async(ns: argparse.Namespace) -> int:
    rng = random.Random(ns.seed)
    config = load_config(ROOT / "config" / "kvmesh.yaml")
    config.engines.template.sim.speed_factor = ns.speed_factor
    config.engines.template.max_running = ns.max_running
    run_dir = Path(ns.run_dir) if ns.run_dir else Path(tempfile.mkdtemp(prefix="kvmesh-chaos-"))
    mesh = Mesh(config, MeshOptions(engines=2, backend="sim", gateways=2, model=MODEL, free_ports=True,
                                    run_dir=run_dir))
    print(f"chaos: seed {ns.seed}, {ns.seconds:.0f}s, {ns.concurrency} concurrent clients; logs in {mesh.log_dir}",
          flush=True)
    t0 = time.monotonic()
    mesh.start()
    try:
        print(f"chaos: mesh up in {time.monotonic() - t0:.1f}s (scheduler, 2 sim engines, 2 gateways, Envoy)",
              flush=True)
        jobs = [Job(f"chaos prompt {i}: {rng.choice(['tell', 'write', 'explain'])} a story about "
                    f"{rng.choice(['meshes', 'engines', 'queues', 'tokens'])} number {rng.randrange(1000)}",
                    rng.randrange(8, ns.max_tokens + 1)) for i in range(ns.distinct)]
        expected = await baseline(mesh, jobs)
        tally = Tally()
        until = time.monotonic() + ns.seconds
        began = time.monotonic()
        chaos_thread = asyncio.create_task(asyncio.to_thread(chaos, mesh, random.Random(rng.random()), until, tally))
        await load(mesh, jobs, expected, random.Random(rng.random()), until, ns.concurrency, tally)
        await chaos_thread
        took = time.monotonic() - began
        for series, value in gateway_counters(mesh, list(range(len(mesh.endpoints.gateway_http)))).items():
            tally.counters[series] += value
    finally:
        mesh.stop_all()
    lost = sum(tally.lost.values())
    print("chaos: faults:")
    for line in tally.actions:
        print(f"  {line}")
    print(f"chaos: {took:.1f}s of load: sent {tally.sent}, completed {tally.completed}, "
          f"rejected {sum(tally.rejected.values())}, lost {lost}")
    for reason, n in tally.rejected.most_common():
        print(f"  rejected {n}: {reason}")
    for reason, n in tally.lost.most_common():
        print(f"  LOST {n}: {reason}")
    for series, value in sorted(tally.counters.items()):
        print(f"  gateway {series} = {value:.0f}")
    return 1 if lost else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="how long to run load and faults")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--concurrency", type=int, default=24, help="concurrent streaming clients")
    parser.add_argument("--distinct", type=int, default=40, help="distinct requests (answers checked)")
    parser.add_argument("--max-tokens", type=int, default=120)
    parser.add_argument("--max-running", type=int, default=16, help="sim engine batch size")
    parser.add_argument("--speed-factor", type=float, default=0.5, help="sim cost model speed factor")
    parser.add_argument("--run-dir", default="", help="mesh run directory (default: a new temp dir)")
    ns = parser.parse_args()
    if ns.seconds <= 0 or ns.seconds > 3600:
        parser.error("--seconds must be in (0, 3600]")
    sys.exit(asyncio.run(main_async(ns)))


if __name__ == "__main__":
    main()
