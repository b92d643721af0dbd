"""What the mesh adds over calling an engine directly (BENCHMARKS.md, "Gateway overhead").

Zero-cost sim engines (`speed_factor 0`: a step costs only its Python time),
no Envoy: the figures are the gateway + scheduler overhead alone. One run,
three phases, each on a fresh mesh of real processes on free ports:

1. TTFT added: the same token-id prompts sent one at a time, alternately
   straight to `Engine.Generate` (gRPC) and through the gateway
   (`POST /v1/completions`, streamed, prompt as token ids). TTFT = request
   sent -> first token received. Added = gateway p50/p99 - direct p50/p99.
2. Relay throughput: `--streams` concurrent streamed completions (a closed
   loop: each worker starts a new one when its stream ends) for `--seconds`;
   tokens/s = sum(usage.completion_tokens) / wall time, plus the gateway
   process's CPU seconds (tokens per gateway CPU-second is the per-process
   capacity when the gateway has a core of its own; here it shares two cores
   with the engines and this client).
3. Held streams: `--hold` SSE streams that stay queued (one engine, one slot,
   blocked by a very slow generation) kept alive only by heartbeats
   (`--heartbeat` s). After `--hold-seconds` a stream counts as alive if it is
   still open and received bytes within the last 2 heartbeats. Gateway RSS and
   CPU are sampled throughout.

    .venv/bin/python scripts/bench_gateway.py                   # ~2-3 min
    .venv/bin/python scripts/bench_gateway.py --phases ttft relay --json out.json
    .venv/bin/python scripts/bench_gateway.py --phases ttft --trace-sink   # tracing on (README "Tracing")

Not a test: it measures. BENCHMARKS.md keeps a run and the targets
(<= 2 ms added TTFT p50, >= 50k tokens/s per gateway process, >= 5,000 held
streams).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import random
import resource
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import grpc

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.bench.stats import percentile
from services.common.config import MeshConfig, load_config
from services.common.proto.kvmesh.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from services.launcher.mesh import Mesh, MeshOptions, start_on_free_ports

MODEL = "tiny-llama"
# `tracing.otlp_endpoint` of every mesh started (--otlp-endpoint / --trace-sink); "" = off.
OTLP_ENDPOINT = ""
# --trace-sink: a loopback OTLP/HTTP receiver that accepts and drops every export.
_SINK = """
import sys
from aiohttp import web
async def take(request):
    await request.read()
    return web.Response(status=200, content_type="application/x-protobuf")
app = web.Application(client_max_size=64 << 20)
app.router.add_post("/v1/traces", take)
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None)
"""
# The sim does not care about position embeddings; long streams need room.
MAX_MODEL_LEN = 65536
# tiny-llama uses SmolLM2's tokenizer; keep prompt ids well inside it.
PROMPT_VOCAB = (100, 40000)
_CLK = os.sysconf("SC_CLK_TCK")


# ---------------------------------------------------------------- helpers


@dataclass
class ProcSample:
    cpu_seconds: float
    rss_mb: float


def proc_sample(pid: int) -> ProcSample:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    cpu = (int(fields[11]) + int(fields[12])) / _CLK  # utime + stime
    rss_kb = 0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss_kb = int(line.split()[1])
    return ProcSample(cpu, rss_kb / 1024)


def raise_fd_limit(wanted: int) -> int:
    """Raise the soft open-files limit (children inherit it); returns it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = min(hard, max(soft, wanted)) if hard != resource.RLIM_INFINITY else max(soft, wanted)
    if target > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


@contextmanager
def running_mesh(tune: Callable[[MeshConfig], None], engines: int) -> Iterator[Mesh]:
    config = load_config(ROOT / "config" / "kvmesh.yaml")
    config.engines.template.sim.speed_factor = 0.0
    for model in config.models:
        if model.name == MODEL:
            model.max_model_len = MAX_MODEL_LEN
    tune(config)
    config.tracing.otlp_endpoint = OTLP_ENDPOINT
    with tempfile.TemporaryDirectory(prefix="kvmesh-bench-gw-") as run_dir:
        mesh = start_on_free_ports(config, MeshOptions(engines=engines, backend="sim", model=MODEL,
                                                       free_ports=True, envoy=False, run_dir=Path(run_dir)))
        try:
            yield mesh
        finally:
            mesh.stop_all()


def _auth(mesh: Mesh) -> dict[str, str]:
    return {"Authorization": f"Bearer {mesh.api_key}"}


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(*PROMPT_VOCAB) for _ in range(n)]


# ---------------------------------------------------------------- phase 1: TTFT


async def _direct_ttft(stub: engine_pb2_grpc.EngineStub, ids: list[int], max_tokens: int) -> float:
    call = stub.Generate()
    request = engine_pb2.EngineRequest(
        request_id=f"bench-{uuid.uuid4().hex}", prompt_token_ids=ids,
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens), priority=1,
    )
    started = time.perf_counter()
    await call.write(engine_pb2.EngineGenerateMessage(request=request))
    ttft = float("nan")
    while True:
        event = await call.read()
        if event is grpc.aio.EOF:
            raise RuntimeError("engine stream ended without finishing")
        if event.HasField("delta") and event.delta.token_ids and ttft != ttft:
            ttft = time.perf_counter() - started
        if event.HasField("finished"):
            break
    await call.done_writing()
    return ttft


async def _gateway_ttft(session: aiohttp.ClientSession, mesh: Mesh, ids: list[int], max_tokens: int) -> float:
    body = {"model": MODEL, "prompt": ids, "max_tokens": max_tokens, "stream": True}
    started = time.perf_counter()
    ttft = float("nan")
    async with session.post(f"{mesh.endpoints.gateway_http[0]}/v1/completions", json=body,
                            headers=_auth(mesh)) as resp:
        if resp.status != 200:
            raise RuntimeError(f"gateway answered {resp.status}: {await resp.text()}")
        async for chunk in resp.content.iter_any():
            if ttft != ttft and b'"text":"' in chunk:
                ttft = time.perf_counter() - started
    return ttft


async def phase_ttft(args: argparse.Namespace) -> dict[str, object]:
    def tune(config: MeshConfig) -> None:
        config.gateway.log_prompts = False

    rng = random.Random(5)
    with running_mesh(tune, engines=1) as mesh:
        os.environ.setdefault("KVMESH_LOG_LEVEL", "WARNING")
        direct: list[float] = []
        via: list[float] = []
        async with grpc.aio.insecure_channel(mesh.endpoints.engines[0]) as channel, \
                aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            stub = engine_pb2_grpc.EngineStub(channel)
            for i in range(args.warmup + args.requests):
                ids = _prompt(rng, args.prompt_tokens)
                # Alternate who goes first: the second sees a warm prefix cache.
                if i % 2:
                    d = await _direct_ttft(stub, ids, args.ttft_max_tokens)
                    g = await _gateway_ttft(session, mesh, ids, args.ttft_max_tokens)
                else:
                    g = await _gateway_ttft(session, mesh, ids, args.ttft_max_tokens)
                    d = await _direct_ttft(stub, ids, args.ttft_max_tokens)
                if i >= args.warmup:
                    direct.append(d)
                    via.append(g)
    ms = 1000.0
    out: dict[str, object] = {
        "requests": len(direct),
        "direct_p50_ms": percentile(direct, 50) * ms, "direct_p99_ms": percentile(direct, 99) * ms,
        "gateway_p50_ms": percentile(via, 50) * ms, "gateway_p99_ms": percentile(via, 99) * ms,
        "added_p50_ms": (percentile(via, 50) - percentile(direct, 50)) * ms,
        "added_p99_ms": (percentile(via, 99) - percentile(direct, 99)) * ms,
        "paired_added_p50_ms": statistics.median(g - d for g, d in zip(via, direct, strict=True)) * ms,
    }
    return out


# ---------------------------------------------------------------- phase 2: relay


async def _relay_worker(
    session: aiohttp.ClientSession, mesh: Mesh, ids: list[int], max_tokens: int, until: float,
    totals: dict[str, int], errors: list[str],
) -> None:
    body = {"model": MODEL, "prompt": ids, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}}
    url = f"{mesh.endpoints.gateway_http[0]}/v1/completions"
    while time.monotonic() < until:
        tail = b""
        async with session.post(url, json=body, headers=_auth(mesh)) as resp:
            if resp.status != 200:
                totals["errors"] += 1
                await asyncio.sleep(0.1)
                continue
            async for chunk in resp.content.iter_any():
                totals["bytes"] += len(chunk)
                tail = (tail + chunk)[-4096:]
        # The usage chunk sits right before [DONE]: no per-chunk parsing here.
        start = tail.rfind(b"data: {")
        last = json.loads(tail[start + 6:].split(b"\n\n", 1)[0]) if start >= 0 else {}
        if not last.get("usage"):
            totals["errors"] += 1
            errors.append(str(last.get("error", tail[-200:]))[:200])
            continue
        totals["tokens"] += last["usage"]["completion_tokens"]
        totals["streams"] += 1


async def phase_relay(args: argparse.Namespace) -> dict[str, object]:
    def tune(config: MeshConfig) -> None:
        t = config.engines.template
        t.max_running = args.streams  # every stream generates at once
        t.total_blocks = 16384
        if args.coalesce_ms is not None:
            t.coalesce_interval_ms = args.coalesce_ms
        config.scheduler.engine_queue_slack = 0

    rng = random.Random(7)
    with running_mesh(tune, engines=args.engines) as mesh:
        gw_pid = mesh.pid("gateway-0")
        engine_pids = [mesh.pid(f"engine-{i}") for i in range(args.engines)]
        assert gw_pid is not None
        totals = {"tokens": 0, "streams": 0, "errors": 0, "bytes": 0}
        errors: list[str] = []
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector,
                                         timeout=aiohttp.ClientTimeout(total=None)) as session:
            # Warm-up: connections, tokenizer, channels.
            warm = {"tokens": 0, "streams": 0, "errors": 0, "bytes": 0}
            await asyncio.gather(*(
                _relay_worker(session, mesh, _prompt(rng, 32), 50, time.monotonic() + 1.0, warm, errors)
                for _ in range(args.streams)))
            gw0 = proc_sample(gw_pid)
            eng0 = [proc_sample(p) for p in engine_pids if p]
            me0 = time.process_time()
            started = time.monotonic()
            until = started + args.seconds
            await asyncio.gather(*(
                _relay_worker(session, mesh, _prompt(rng, 32), args.stream_tokens, until, totals, errors)
                for _ in range(args.streams)))
            wall = time.monotonic() - started
            gw1 = proc_sample(gw_pid)
            eng1 = [proc_sample(p) for p in engine_pids if p]
            client_cpu = time.process_time() - me0
    gw_cpu = gw1.cpu_seconds - gw0.cpu_seconds
    return {
        "streams": args.streams, "engines": args.engines, "wall_s": wall,
        "completed_streams": totals["streams"], "errors": totals["errors"], "first_errors": sorted(set(errors))[:3],
        "tokens": totals["tokens"], "tokens_per_s": totals["tokens"] / wall,
        "sse_mb": totals["bytes"] / 1e6,
        "gateway_cpu_s": gw_cpu, "gateway_cpu_util": gw_cpu / wall,
        "tokens_per_gateway_cpu_s": totals["tokens"] / gw_cpu if gw_cpu else float("nan"),
        "engines_cpu_s": sum(b.cpu_seconds - a.cpu_seconds for a, b in zip(eng0, eng1, strict=True)),
        "client_cpu_s": client_cpu,
        "gateway_rss_mb": gw1.rss_mb,
    }


# ---------------------------------------------------------------- phase 3: hold


@dataclass
class _Held:
    opened: bool = False
    closed: bool = False
    status: int = 0
    last_rx: float = 0.0
    heartbeats: int = 0
    error: str = ""


async def _hold_one(session: aiohttp.ClientSession, mesh: Mesh, state: _Held, max_tokens: int = 4) -> None:
    body = {"model": MODEL, "prompt": "wait your turn", "max_tokens": max_tokens, "stream": True}
    try:
        async with session.post(f"{mesh.endpoints.gateway_http[0]}/v1/completions", json=body,
                                headers=_auth(mesh)) as resp:
            state.status = resp.status
            state.opened = resp.status == 200
            state.last_rx = time.monotonic()
            async for chunk in resp.content.iter_any():
                state.last_rx = time.monotonic()
                state.heartbeats += chunk.count(b": keep-alive")
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001 - counted, not fatal
        state.error = f"{type(exc).__name__}: {exc}"
    state.closed = True


async def phase_hold(args: argparse.Namespace) -> dict[str, object]:
    n = args.hold

    def tune(config: MeshConfig) -> None:
        t = config.engines.template
        t.max_running = 1
        t.sim.speed_factor = 100.0  # ~0.8 s per token: the blocker holds the one slot for minutes
        s = config.scheduler
        s.engine_queue_slack = 0
        s.queue_caps = [n + 100] * 3
        s.tenant_queue_cap = n + 100
        # Position updates every 30 s instead of 1 s: the heartbeat is what
        # this phase measures (5,000 updates/s would be a scheduler benchmark).
        s.queued_update_seconds = 30.0
        config.gateway.heartbeat_seconds = args.heartbeat
        config.gateway.max_generation_seconds = 3600.0

    fd_limit = raise_fd_limit(2 * n + 1024)
    with running_mesh(tune, engines=1) as mesh:
        gw_pid = mesh.pid("gateway-0")
        assert gw_pid is not None
        base = proc_sample(gw_pid)
        states = [_Held() for _ in range(n)]
        connector = aiohttp.TCPConnector(limit=0)
        samples: list[tuple[float, ProcSample]] = []
        async with aiohttp.ClientSession(connector=connector,
                                         timeout=aiohttp.ClientTimeout(total=None)) as session:
            blocker = _Held()
            tasks = [asyncio.create_task(_hold_one(session, mesh, blocker, max_tokens=5000))]
            while not (blocker.opened or blocker.closed):
                await asyncio.sleep(0.1)
            open_started = time.monotonic()
            for i in range(0, n, args.open_batch):
                tasks += [asyncio.create_task(_hold_one(session, mesh, s)) for s in states[i:i + args.open_batch]]
                await asyncio.sleep(args.open_batch / args.open_rate)
            # Every stream answers 200 at its first heartbeat.
            deadline = time.monotonic() + 4 * args.heartbeat + 60
            while time.monotonic() < deadline and sum(s.opened or s.closed for s in states) < n:
                await asyncio.sleep(0.5)
            opened_after = time.monotonic() - open_started
            hold_started = time.monotonic()
            after_open = proc_sample(gw_pid)
            while time.monotonic() - hold_started < args.hold_seconds:
                await asyncio.sleep(1.0)
                samples.append((time.monotonic(), proc_sample(gw_pid)))
            now = time.monotonic()
            alive = sum(s.opened and not s.closed and now - s.last_rx <= 2 * args.heartbeat for s in states)
            errors = [s.error or f"status {s.status}" for s in states if s.closed or not s.opened]
            end = proc_sample(gw_pid)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    hold_wall = samples[-1][0] - hold_started if samples else float("nan")
    return {
        "streams": n, "fd_limit": fd_limit, "heartbeat_s": args.heartbeat, "hold_s": args.hold_seconds,
        "alive": alive, "failed": len(errors), "first_errors": sorted(set(errors))[:5],
        "open_seconds": opened_after,
        "heartbeats_per_stream_min": min((s.heartbeats for s in states if s.opened), default=0),
        "gateway_rss_mb_idle": base.rss_mb, "gateway_rss_mb_held": end.rss_mb,
        "gateway_kb_per_stream": (end.rss_mb - base.rss_mb) * 1024 / max(1, alive),
        "gateway_cpu_util_while_holding": (end.cpu_seconds - after_open.cpu_seconds) / hold_wall,
    }


# ---------------------------------------------------------------- main


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--phases", nargs="+", default=["ttft", "relay", "hold"], choices=["ttft", "relay", "hold"])
    p.add_argument("--requests", type=int, default=300, help="TTFT pairs measured")
    p.add_argument("--warmup", type=int, default=30, help="TTFT pairs discarded first")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--ttft-max-tokens", type=int, default=4)
    p.add_argument("--streams", type=int, default=200, help="concurrent streams for the relay phase")
    p.add_argument("--engines", type=int, default=1, help="engines for the relay phase")
    p.add_argument("--stream-tokens", type=int, default=2000, help="tokens per relayed stream")
    p.add_argument("--seconds", type=float, default=20.0, help="relay phase duration")
    p.add_argument("--coalesce-ms", type=float, default=None,
                   help="engines' coalesce_interval_ms for the relay phase (default: the config's; "
                        "0 = a delta per engine step, the gateway's worst case)")
    p.add_argument("--hold", type=int, default=5000, help="streams to hold")
    p.add_argument("--heartbeat", type=float, default=5.0, help="gateway heartbeat seconds (hold phase)")
    p.add_argument("--hold-seconds", type=float, default=30.0)
    p.add_argument("--open-batch", type=int, default=250)
    p.add_argument("--open-rate", type=float, default=1000.0, help="streams opened per second")
    p.add_argument("--json", type=Path, help="also write the results here")
    p.add_argument("--otlp-endpoint", default="", help="trace every service to this OTLP/HTTP receiver")
    p.add_argument("--trace-sink", action="store_true",
                   help="trace to a loopback receiver started here (it accepts and drops the spans)")
    return p


@contextmanager
def trace_sink() -> Iterator[str]:
    """A throwaway OTLP/HTTP receiver process on a free port; its URL."""
    import socket
    import subprocess

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    sink = subprocess.Popen([sys.executable, "-c", _SINK, str(port)])
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.1)
        yield f"http://127.0.0.1:{port}"
    finally:
        sink.terminate()
        sink.wait(10)


def main() -> None:
    args = _parser().parse_args()
    os.environ.setdefault("KVMESH_LOG_LEVEL", "WARNING")
    logging.basicConfig(level=logging.WARNING)
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    global OTLP_ENDPOINT  # noqa: PLW0603 - read by running_mesh
    with contextlib.ExitStack() as stack:
        OTLP_ENDPOINT = stack.enter_context(trace_sink()) if args.trace_sink else args.otlp_endpoint
        _run_phases(args)


def _run_phases(args: argparse.Namespace) -> None:
    results: dict[str, object] = {"cpus": os.cpu_count(), "tracing": OTLP_ENDPOINT or "off"}
    phases = {"ttft": phase_ttft, "relay": phase_relay, "hold": phase_hold}
    for name in args.phases:
        started = time.monotonic()
        results[name] = report = asyncio.run(phases[name](args))
        print(f"== {name} ({time.monotonic() - started:.0f} s)")
        for key, value in report.items():
            print(f"  {key:32s} {value:.2f}" if isinstance(value, float) else f"  {key:32s} {value}")
        sys.stdout.flush()
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
