"""Chaos run: load through Envoy while engines, their cores, the scheduler and
gateways are killed, hung and rolled at random. Prints what clients saw;
exits 1 if any request was lost.

    .venv/bin/python scripts/chaos.py --seconds 60 --seed 7
    .venv/bin/python scripts/chaos.py --faults gateway-roll,gateway-kill --seconds 90

The mesh: scheduler, 2 engines (sim by default; `--backend vllm`), 2
gateways, Envoy -- real processes on free loopback ports, in a temporary run
directory, restarted as `kvmesh up` restarts them (its `Restarts` policy:
the scheduler and engines come back on their own). Faults, one at a time,
chosen with the seeded RNG every few seconds from `--faults`:

- engine-kill: SIGKILL of an engine service, restarted a moment later
  (its streams migrate mid-answer);
- scheduler-kill: SIGKILL of the scheduler, restarted as `kvmesh up` does
  (gateways re-admit queued requests and re-attach running ones);
- core-kill: SIGKILL of an engine's `VLLM::EngineCore` process (vLLM only:
  the engine fails as a whole, its streams migrate, it exits and restarts).
  The sim has no core process and its crash hook is in-process only: the
  fault is skipped with a message;
- hang: SIGSTOP for `--hang-seconds`, then SIGCONT, of an engine's
  `EngineCore` (vLLM: the engine's hang detection fails it over) or of the
  sim engine process itself (a frozen host: the gateways' keepalive ends its
  streams and they migrate);
- gateway-roll: a rolling restart of both gateways (`Mesh.rolling_restart`:
  each drains on SIGTERM -- not ready, Envoy takes it out, its streams
  finish -- exits, comes back, is in rotation again before the next);
- gateway-kill: SIGKILL of a gateway, restarted a moment later. Its
  clients' streams break mid-answer; each client re-sends the same request
  with `Last-Event-ID: <the last SSE event id it got>` and appends only the
  events after it (what a browser's EventSource does). Without server-side
  resume the re-sent request starts over: the run then shows those streams
  as lost (text repeated), the honest result.

Every answer is checked against an uninterrupted answer to the same request
taken before the chaos (the sim's text is deterministic, like greedy
decoding), so a repeated or missing token counts as lost.

Outcomes: completed (200, finish length/stop, [DONE], text as expected;
"resumed" counts those that needed a Last-Event-ID resume); rejected (an
HTTP status with an OpenAI error body, or an SSE error event before any
text: a definite answer the client can act on, by reason); lost (anything
else: a stream cut that could not be resumed, a wrong text, an error after
text, a timeout).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import signal
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.common.affinity import descendants
from services.common.config import load_config
from services.launcher.mesh import Mesh, MeshOptions
from services.launcher.up import Restarts

SIM_MODEL = "tiny-llama"
REQUEST_TIMEOUT_SECONDS = 180.0
MAX_RESUMES = 5
FAULTS = ("engine-kill", "scheduler-kill", "core-kill", "hang", "gateway-roll", "gateway-kill")
_COUNTERS = ("kvmesh_gateway_migrations_total", "kvmesh_gateway_scheduler_readmissions_total",
             "kvmesh_gateway_drain_cut_total")


@dataclass
class Tally:
    sent: int = 0
    completed: int = 0
    # Completed streams that needed a Last-Event-ID resume / a plain re-send
    # (cut before any event id arrived).
    resumed: int = 0
    resent: int = 0
    rejected: collections.Counter[str] = field(default_factory=collections.Counter)
    lost: collections.Counter[str] = field(default_factory=collections.Counter)
    actions: list[str] = field(default_factory=list)
    # Gateway counters (migrations, re-admissions) summed over every gateway life.
    counters: dict[str, float] = field(default_factory=lambda: collections.defaultdict(float))


@dataclass(frozen=True)
class Job:
    prompt: str
    max_tokens: int


@dataclass
class Answer:
    outcome: str  # "ok", "rejected", "lost"
    reason: str = ""
    text: str = ""
    resumes: int = 0
    resent: int = 0
    cuts: list[str] = field(default_factory=list)  # why each attempt before the last ended


class _Cut(Exception):
    """The stream broke before [DONE]."""


# ------------------------------------------------------------------ the client


async def sse_events(content: aiohttp.StreamReader) -> AsyncIterator[tuple[str | None, str]]:
    """(event id or None, data) per SSE event; comments skipped."""
    event_id: str | None = None
    data: list[str] = []
    async for raw in content:
        line = raw.decode(errors="replace").rstrip("\r\n")
        if not line:
            if data:
                yield event_id, "\n".join(data)
            event_id, data = None, []
        elif line.startswith("id:"):
            event_id = line[3:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].strip())
    if data:
        yield event_id, "\n".join(data)


def _event_index(event_id: str) -> tuple[str, int] | None:
    rid, _, n = event_id.rpartition(".")
    return (rid, int(n)) if rid and n.isdigit() else None


class ResumingStream:
    """One streamed completion that survives a broken connection: re-sent
    with Last-Event-ID = the last event id it got, keeping only events after
    it. A server that ignores the header starts over, with new event ids:
    those events are appended as they come, so the text shows it."""

    def __init__(self, session: aiohttp.ClientSession, mesh: Mesh, job: Job, model: str) -> None:
        self._session, self._mesh = session, mesh
        self._body = {"model": model, "prompt": job.prompt, "max_tokens": job.max_tokens, "stream": True,
                      "temperature": 0}
        self.answer = Answer("lost")
        self._last_id: str | None = None
        self._finish: str | None = None

    async def run(self) -> Answer:
        try:
            async with asyncio.timeout(REQUEST_TIMEOUT_SECONDS):
                return await self._attempts()
        except TimeoutError:
            return self._lost("timeout")

    async def _attempts(self) -> Answer:
        for attempt in range(MAX_RESUMES + 1):
            try:
                return await self._attempt()
            except _Cut as cut:
                reason = str(cut)
            except (aiohttp.ClientError, ValueError) as exc:
                reason = type(exc).__name__
            self.answer.cuts.append(f"{reason} after {self._last_id}")
            if self._last_id is None and self.answer.text:
                return self._lost(f"cut after text with no event id to resume from ({reason})")
            if self._last_id is None:
                self.answer.resent += 1
            else:
                self.answer.resumes += 1
            await asyncio.sleep(0.2 * (attempt + 1))
        return self._lost(f"still cut after {MAX_RESUMES} resumes")

    def _lost(self, reason: str) -> Answer:
        self.answer.outcome = "lost"
        self.answer.reason = reason + (f" (cut before: {'; '.join(self.answer.cuts)})" if self.answer.cuts else "")
        return self.answer

    async def _attempt(self) -> Answer:
        headers = {"Authorization": f"Bearer {self._mesh.api_key}"}
        if self._last_id is not None:
            headers["Last-Event-ID"] = self._last_id
        url = f"{self._mesh.endpoints.public_http}/v1/completions"
        async with self._session.post(url, json=self._body, headers=headers) as resp:
            if resp.status != 200:
                return await self._refused(resp)
            async for event_id, data in sse_events(resp.content):
                if data == "[DONE]":
                    return self._done()
                if event_id is not None and not self._is_new(event_id):
                    continue
                event = json.loads(data)
                if "error" in event:
                    code = event["error"].get("code") or "error"
                    if self.answer.text:
                        return self._lost(f"error after text: {code}")
                    self.answer.outcome, self.answer.reason = "rejected", f"sse error {code}"
                    return self.answer
                for choice in event.get("choices", ()):
                    self.answer.text += choice.get("text") or ""
                    self._finish = choice.get("finish_reason") or self._finish
        raise _Cut("stream ended without [DONE]")

    def _is_new(self, event_id: str) -> bool:
        """Keep an event unless it repeats one already kept (same request
        id, index not after the last); remember it as the last."""
        new, last = _event_index(event_id), _event_index(self._last_id) if self._last_id else None
        if new is not None and last is not None and new[0] == last[0] and new[1] <= last[1]:
            return False
        self._last_id = event_id
        return True

    async def _refused(self, resp: aiohttp.ClientResponse) -> Answer:
        raw = await resp.text()
        try:
            error = json.loads(raw)["error"]
            code, message = error.get("code") or "error", str(error.get("message", ""))
        except (ValueError, KeyError, TypeError, AttributeError):
            return self._lost(f"http {resp.status} without an error body")
        if self.answer.text or self._last_id is not None:
            return self._lost(f"resume answered http {resp.status} {code}: {message[:80]}")
        self.answer.outcome, self.answer.reason = "rejected", f"http {resp.status} {code}: {message[:90]}"
        return self.answer

    def _done(self) -> Answer:
        if self._finish not in ("length", "stop"):
            return self._lost(f"[DONE] without a finish reason (finish={self._finish})")
        self.answer.outcome, self.answer.reason = "ok", self._finish or ""
        return self.answer


async def baseline(mesh: Mesh, jobs: list[Job], model: str) -> dict[Job, str]:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        answers = await asyncio.gather(*(ResumingStream(session, mesh, j, model).run() for j in jobs))
    bad = [(j, a.reason) for j, a in zip(jobs, answers, strict=True) if a.outcome != "ok" or a.resumes]
    if bad:
        raise SystemExit(f"chaos: the baseline run failed before any fault: {bad[:3]}")
    return {j: a.text for j, a in zip(jobs, answers, strict=True)}


def record(tally: Tally, answer: Answer, expected: str) -> None:
    if answer.outcome == "ok" and answer.text != expected:
        answer.outcome = "lost"
        answer.reason = ("text differs from the uninterrupted answer"
                         + (" after a resume" if answer.resumes else ""))
    if answer.outcome == "ok":
        tally.completed += 1
        tally.resumed += bool(answer.resumes)
        tally.resent += bool(answer.resent)
    elif answer.outcome == "rejected":
        tally.rejected[answer.reason] += 1
    else:
        tally.lost[answer.reason] += 1


async def load(mesh: Mesh, jobs: list[Job], expected: dict[Job, str], model: str, rng: random.Random,
               until: float, concurrency: int, tally: Tally) -> None:
    async def worker(seed: int) -> None:
        local = random.Random(seed)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            while time.monotonic() < until:
                job = local.choice(jobs)
                tally.sent += 1
                answer = await ResumingStream(session, mesh, job, model).run()
                record(tally, answer, expected[job])
                if answer.outcome == "rejected":
                    await asyncio.sleep(0.2)  # a client backs off after a refusal
    await asyncio.gather(*(worker(rng.randrange(2**32)) for _ in range(concurrency)))


# ------------------------------------------------------------------ faults


def gateway_counters(mesh: Mesh, replicas: list[int]) -> dict[str, float]:
    """Migration / re-admission / drain-cut counters summed over these gateway replicas."""
    out: dict[str, float] = collections.defaultdict(float)
    for r in replicas:
        port = mesh.config.gateway.metrics_port + r
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
                text = resp.read().decode()
        except OSError:
            continue
        for line in text.splitlines():
            if line.startswith(_COUNTERS):
                series, value = line.rsplit(" ", 1)
                out[series] += float(value)
    return out


def _engine_core(mesh: Mesh, engine: str) -> int | None:
    """The pid of the engine's VLLM::EngineCore process, None if it has none."""
    pid = mesh.pid(engine)
    if pid is None:
        return None
    for child in descendants(pid):
        try:
            if b"EngineCore" in Path(f"/proc/{child}/cmdline").read_bytes():
                return child
        except OSError:
            continue
    return None


class Chaos:
    """The fault loop (runs in a thread: Mesh is driven from one thread)."""

    def __init__(self, mesh: Mesh, rng: random.Random, faults: list[str], hang_seconds: float,
                 tally: Tally) -> None:
        self.mesh, self.rng, self.tally, self.hang_seconds = mesh, rng, tally, hang_seconds
        self.engines = [n for n in mesh.names if n.startswith("engine-")]
        self.gateways = [n for n in mesh.names if n.startswith("gateway-")]
        self.vllm = mesh.config.engines.backend == "vllm"
        self.faults = list(faults)
        self.stop = threading.Event()
        self.restarts = Restarts(mesh, self.stop)
        if "core-kill" in self.faults and not self.vllm:
            self.faults.remove("core-kill")
            tally.actions.append("core-kill skipped: the sim has no engine-core process, and its crash hook "
                                 "is reachable only in-process")
        self.run_fault: dict[str, Callable[[], str]] = {
            "engine-kill": self.engine_kill, "scheduler-kill": self.scheduler_kill,
            "core-kill": self.core_kill, "hang": self.hang,
            "gateway-roll": self.gateway_roll, "gateway-kill": self.gateway_kill,
        }

    def run(self, until: float) -> None:
        start = time.monotonic()
        while time.monotonic() < until - 3.0 and self.faults:
            time.sleep(self.rng.uniform(1.0, 3.0))
            self.restarts.check()  # engines that failed over on their own come back, as under kvmesh up
            kind = self.rng.choice(self.faults)
            at = time.monotonic() - start
            what = self.run_fault[kind]()
            self.tally.actions.append(f"{at:5.1f}s {kind}: {what} (+{time.monotonic() - start - at:.1f}s)")
            self.restarts.check()
        self.stop.set()

    def _keep_counters(self, names: list[str]) -> None:
        """A gateway's counters die with it: keep them."""
        for series, value in gateway_counters(self.mesh, [self.gateways.index(n) for n in names]).items():
            self.tally.counters[series] += value

    def engine_kill(self) -> str:
        name = self.rng.choice(self.engines)
        self.mesh.kill(name)
        time.sleep(self.rng.uniform(0.5, 2.0))
        self.mesh.restart(name)
        return f"SIGKILL {name}, restarted"

    def scheduler_kill(self) -> str:
        self.mesh.kill("scheduler")
        time.sleep(self.rng.uniform(0.0, 1.0))
        self.mesh.restart("scheduler")
        return "SIGKILL scheduler, healthy again"

    def core_kill(self) -> str:
        name = self.rng.choice(self.engines)
        core = _engine_core(self.mesh, name)
        if core is None:
            return f"{name} has no EngineCore process right now; nothing done"
        os.kill(core, signal.SIGKILL)
        return f"SIGKILL {name}'s EngineCore (pid {core})"

    def hang(self) -> str:
        name = self.rng.choice(self.engines)
        pid = _engine_core(self.mesh, name) if self.vllm else self.mesh.pid(name)
        if pid is None:
            return f"{name}: no process to stop; nothing done"
        os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(self.hang_seconds)
        finally:
            os.kill(pid, signal.SIGCONT)
        what = "EngineCore" if self.vllm else "process"
        return f"SIGSTOP {name}'s {what} (pid {pid}) for {self.hang_seconds:g}s, then SIGCONT"

    def gateway_roll(self) -> str:
        self._keep_counters(self.gateways)
        steps = self.mesh.rolling_restart()
        return "rolled " + ", ".join(f"{s.name} (exit {s.exit_code}, {s.seconds:.1f}s)" for s in steps)

    def gateway_kill(self) -> str:
        name = self.rng.choice(self.gateways)
        self._keep_counters([name])
        self.mesh.kill(name)
        time.sleep(self.rng.uniform(0.5, 2.0))
        self.mesh.restart(name)
        return f"SIGKILL {name}, restarted"


# ------------------------------------------------------------------ the run


def _mesh(ns: argparse.Namespace) -> tuple[Mesh, str]:
    config = load_config(ROOT / "config" / "kvmesh.yaml")
    config.engines.template.sim.speed_factor = ns.speed_factor
    config.engines.template.max_running = ns.max_running
    model = SIM_MODEL if ns.backend == "sim" else ""
    run_dir = Path(ns.run_dir) if ns.run_dir else Path(tempfile.mkdtemp(prefix="kvmesh-chaos-"))
    mesh = Mesh(config, MeshOptions(engines=2, backend=ns.backend, gateways=2, model=model or None,
                                    free_ports=True, run_dir=run_dir))
    return mesh, mesh.config.engines.template.model


def _drain_cuts(mesh: Mesh) -> int:
    """Streams gateways cut at their drain bound (they log it, then exit)."""
    cuts = 0
    for path in mesh.log_dir.glob("gateway-*.log"):
        for line in path.read_text(errors="replace").splitlines():
            if "still in flight" in line and "drain:" in line:
                cuts += int(line.split("drain: ", 1)[1].split(" ", 1)[0])
    return cuts


def report(tally: Tally, took: float, mesh: Mesh) -> int:
    lost = sum(tally.lost.values())
    print("chaos: faults:")
    for line in tally.actions:
        print(f"  {line}")
    print(f"chaos: {took:.1f}s of load: sent {tally.sent}, completed {tally.completed} "
          f"(resumed with Last-Event-ID {tally.resumed}, re-sent before any event {tally.resent}), "
          f"rejected {sum(tally.rejected.values())}, lost {lost}")
    for reason, n in tally.rejected.most_common():
        print(f"  rejected {n}: {reason}")
    for reason, n in tally.lost.most_common():
        print(f"  LOST {n}: {reason}")
    for series, value in sorted(tally.counters.items()):
        print(f"  gateway {series} = {value:.0f}")
    print(f"  streams cut at a gateway's drain bound (gateway logs): {_drain_cuts(mesh)}")
    return 1 if lost else 0


async def main_async(ns: argparse.Namespace) -> int:
    rng = random.Random(ns.seed)
    mesh, model = _mesh(ns)
    faults = ns.faults.split(",")
    print(f"chaos: seed {ns.seed}, {ns.seconds:.0f}s, {ns.concurrency} concurrent clients, faults "
          f"{', '.join(faults)}; logs in {mesh.log_dir}", flush=True)
    t0 = time.monotonic()
    mesh.start()
    try:
        print(f"chaos: mesh up in {time.monotonic() - t0:.1f}s (scheduler, 2 {ns.backend} engines, 2 gateways, "
              "Envoy)", flush=True)
        jobs = [Job(f"chaos prompt {i}: {rng.choice(['tell', 'write', 'explain'])} a story about "
                    f"{rng.choice(['meshes', 'engines', 'queues', 'tokens'])} number {rng.randrange(1000)}",
                    rng.randrange(8, ns.max_tokens + 1)) for i in range(ns.distinct)]
        expected = await baseline(mesh, jobs, model)
        tally = Tally()
        until = time.monotonic() + ns.seconds
        began = time.monotonic()
        chaos = Chaos(mesh, random.Random(rng.random()), faults, ns.hang_seconds, tally)
        chaos_thread = asyncio.create_task(asyncio.to_thread(chaos.run, until))
        await load(mesh, jobs, expected, model, random.Random(rng.random()), until, ns.concurrency, tally)
        await chaos_thread
        took = time.monotonic() - began
        for series, value in gateway_counters(mesh, list(range(len(mesh.endpoints.gateway_http)))).items():
            tally.counters[series] += value
    finally:
        mesh.stop_all()
    return report(tally, took, mesh)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="how long to run load and faults")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--faults", default=",".join(FAULTS), help=f"comma-separated, of {', '.join(FAULTS)}")
    parser.add_argument("--backend", choices=["sim", "vllm"], default="sim")
    parser.add_argument("--hang-seconds", type=float, default=8.0, help="how long `hang` keeps a process stopped")
    parser.add_argument("--concurrency", type=int, default=24, help="concurrent streaming clients")
    parser.add_argument("--distinct", type=int, default=40, help="distinct requests (answers checked)")
    parser.add_argument("--max-tokens", type=int, default=120)
    parser.add_argument("--max-running", type=int, default=16, help="sim engine batch size")
    parser.add_argument("--speed-factor", type=float, default=0.5, help="sim cost model speed factor")
    parser.add_argument("--run-dir", default="", help="mesh run directory (default: a new temp dir)")
    ns = parser.parse_args()
    if ns.seconds <= 0 or ns.seconds > 3600:
        parser.error("--seconds must be in (0, 3600]")
    unknown = set(ns.faults.split(",")) - set(FAULTS)
    if unknown:
        parser.error(f"--faults: unknown {', '.join(sorted(unknown))}; known: {', '.join(FAULTS)}")
    if not 0 < ns.hang_seconds <= 300:
        parser.error("--hang-seconds must be in (0, 300]")
    sys.exit(asyncio.run(main_async(ns)))


if __name__ == "__main__":
    main()
