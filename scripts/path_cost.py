"""Wake-ups per request on each process of the kvmesh path, under the load of
BENCHMARKS.md's router comparison (the all-fits workload).

    flock /work/wt/bench19.lock .venv/bin/python scripts/path_cost.py [--requests 300] [--strace gateway]

One mesh of 8 sim engines built exactly as `scripts/bench_peers.py` builds it
(its own functions), the default policy, the warm-up, then the measured run.
Around the measured run it reads, for Envoy, the gateway, the scheduler and
the engines (summed), every thread's voluntary and involuntary context
switches (/proc/PID/task/*/status) and the process's CPU time
(/proc/PID/stat), and prints each per request. `--strace NAME` also attaches
`strace -c -f` to that child for the measured run (it slows the child: read
its syscall counts, not the TTFT of that run).

`--short` measures issue 27's short-request run instead: a mesh as
`kvmesh up` starts it (default config) with 2 zero-cost sim engines
(`speed_factor 0`), 1 gateway and Envoy, driven by `--clients` closed-loop
clients through Envoy, each sending non-streamed `/v1/completions` of
`--max-tokens` tokens back to back for `--seconds` (after 2 s unmeasured);
it prints req/s and the same per-request figures.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import bench_peers as bp

from services.bench.runner import Target
from services.common.affinity import descendants
from services.common.config import load_config
from services.launcher.mesh import Mesh, MeshOptions

_TICK = os.sysconf("SC_CLK_TCK")


@dataclass
class Sample:
    voluntary: int = 0
    involuntary: int = 0
    cpu_s: float = 0.0
    threads: int = 0
    by_thread: dict[str, int] = field(default_factory=dict)  # comm -> voluntary switches


def _read(pid: int) -> Sample:
    s = Sample()
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            comm = (task / "comm").read_text().strip()
            for line in (task / "status").read_text().splitlines():
                if line.startswith("voluntary_ctxt_switches"):
                    s.voluntary += int(line.split()[1])
                    s.by_thread[comm] = s.by_thread.get(comm, 0) + int(line.split()[1])
                elif line.startswith("nonvoluntary_ctxt_switches"):
                    s.involuntary += int(line.split()[1])
            s.threads += 1
        except FileNotFoundError:
            continue
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    s.cpu_s = (int(fields[11]) + int(fields[12])) / _TICK
    return s


def process_groups(mesh: Mesh) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for name in mesh.names:
        pid = mesh.pid(name)
        if pid is None:
            continue
        key = "engines" if name.startswith("engine") else name
        out.setdefault(key, []).extend([pid, *descendants(pid)])
    return out


def sample(groups: dict[str, list[int]]) -> dict[str, Sample]:
    out: dict[str, Sample] = {}
    for key, pids in groups.items():
        total = Sample()
        for pid in pids:
            try:
                s = _read(pid)
            except FileNotFoundError:
                continue
            total.voluntary += s.voluntary
            total.involuntary += s.involuntary
            total.cpu_s += s.cpu_s
            total.threads += s.threads
            for comm, n in s.by_thread.items():
                total.by_thread[comm] = total.by_thread.get(comm, 0) + n
        out[key] = total
    return out


def short_mesh(run_dir: Path, engine_http: bool = False) -> Mesh:
    """The issue's mesh: `kvmesh up`'s config, 2 zero-cost sim engines
    (`engine_http`: with their own OpenAI endpoints, for a peer router)."""
    config = load_config(ROOT / "config" / "kvmesh.yaml")
    config.engines.template.sim.speed_factor = 0.0
    if engine_http:
        config.engines.http_base_port = 1      # non-zero = on; the launcher picks free ports
    return Mesh(config, MeshOptions(engines=2, backend="sim", model=bp.MODEL, free_ports=True, run_dir=run_dir))


@dataclass
class LoopResult:
    ok: int = 0
    errors: int = 0
    seconds: float = 0.0
    latencies: list[float] = field(default_factory=list)


async def closed_loop(mesh: Mesh, args: argparse.Namespace, groups: dict[str, list[int]],
                       window: list[dict[str, Sample]]) -> LoopResult:
    """`args.clients` workers, each one non-streamed completion after the
    other; counts those that end inside the measured window, sampling the
    processes at its two ends into `window`."""
    url = f"{mesh.endpoints.public_http}/v1/completions"
    headers = {"Authorization": f"Bearer {mesh.api_key}"}
    body = {"model": bp.MODEL, "prompt": "Say hello to the mesh.", "max_tokens": args.max_tokens}
    result = LoopResult()
    bounds = [float("inf"), float("inf")]
    stop = time.monotonic() + args.warm_seconds + args.seconds + 60

    async def worker(session: aiohttp.ClientSession) -> None:
        while time.monotonic() < stop:
            started = time.monotonic()
            async with session.post(url, json=body, headers=headers) as resp:
                await resp.read()
                ok = resp.status == 200
            ended = time.monotonic()
            if bounds[0] <= ended <= bounds[1]:
                result.ok += ok
                result.errors += not ok
                result.latencies.append(ended - started)

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        tasks = [asyncio.create_task(worker(session)) for _ in range(args.clients)]
        await asyncio.sleep(args.warm_seconds)
        window.append(sample(groups))
        bounds[0] = time.monotonic()
        await asyncio.sleep(args.seconds)
        bounds[1] = time.monotonic()
        window.append(sample(groups))
        stop = 0.0
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    result.seconds = bounds[1] - bounds[0]
    return result


def _run_short(args: argparse.Namespace) -> tuple[int, dict[str, Sample], dict[str, Sample]]:
    with tempfile.TemporaryDirectory(prefix="kvmesh-pathcost-") as tmp:
        mesh = short_mesh(Path(tmp))
        mesh.start()
        try:
            print("children:", mesh.names, file=sys.stderr)
            groups = process_groups(mesh)
            spies = _spies(mesh, args)
            window: list[dict[str, Sample]] = []
            result = asyncio.run(closed_loop(mesh, args, groups, window))
            _stop_spies(spies)
        finally:
            mesh.stop_all()
    lat = sorted(result.latencies) or [0.0]
    print(f"\n{args.clients} clients, {args.max_tokens} tokens, {result.seconds:.1f} s: {result.ok} ok, "
          f"{result.errors} errors, {result.ok / result.seconds:.1f} req/s; latency p50/p99 ms "
          f"{lat[len(lat) // 2] * 1000:.1f}/{lat[int(len(lat) * 0.99)] * 1000:.1f}; "
          f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return result.ok, window[0], window[1]


def _spies(mesh: Mesh, args: argparse.Namespace) -> list[subprocess.Popen[bytes]]:
    return [subprocess.Popen([args.pyspy_bin, "record", "--nonblocking", "-r", "200", "-f", "raw",
                              "-o", f"/tmp/pyspy-{name}.txt", "-p", str(mesh.pid(name))],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for name in args.pyspy]


def _stop_spies(spies: list[subprocess.Popen[bytes]]) -> None:
    for spy in spies:
        spy.send_signal(signal.SIGINT)
        spy.wait()


def _run_all_fits(args: argparse.Namespace) -> tuple[int, dict[str, Sample], dict[str, Sample]]:
    peers_args = argparse.Namespace(
        profile=str(ROOT / "config" / "sim-profiles" / "llama3-8b-a100.yaml"), speed_factor=4.0,
        total_blocks=640, max_running=0, max_model_len=16384, requests=args.requests, seed=1, groups=16,
        context_tokens=2000, max_tokens=16, rate=args.rate)
    count = bp.token_counter(str(ROOT / ".models" / bp.MODEL))
    workload = bp.all_fits(peers_args)
    with tempfile.TemporaryDirectory(prefix="kvmesh-pathcost-") as tmp:
        mesh = Mesh(bp.mesh_config(peers_args), MeshOptions(engines=8, backend="sim", model=bp.MODEL,
                                                           free_ports=True, run_dir=Path(tmp)))
        mesh.start()
        try:
            print("children:", mesh.names, file=sys.stderr)
            target = Target(mesh.endpoints.public_http, bp.MODEL, mesh.api_key)
            spec = workload.spec("[path] ")
            bp.warm_up(workload, spec, target, count)
            groups = process_groups(mesh)
            tracer: subprocess.Popen[bytes] | None = None
            if args.strace:
                pid = mesh.pid(args.strace)
                out = f"/tmp/strace-{args.strace}.txt"
                tracer = subprocess.Popen(["strace", "-c", "-f", "-p", str(pid), "-o", out])
            spies = _spies(mesh, args)
            before = sample(groups)
            # bench_peers' run_one would warm up again inside the sampled window: only its measured run.
            _, summary = asyncio.run(bp.bench(spec, workload.arrival, target, count,
                                              label="kvmesh:sticky_until_saturated"))
            after = sample(groups)
            _stop_spies(spies)
            if tracer is not None:
                tracer.send_signal(signal.SIGINT)
                tracer.wait()
                print(Path(f"/tmp/strace-{args.strace}.txt").read_text())
        finally:
            mesh.stop_all()
    n = summary["overall"]["ok"]
    o = summary["overall"]["ttft_s"]
    print(f"\n{n} requests; TTFT p50/p90/p99 ms {o['p50']*1000:.0f}/{o['p90']*1000:.0f}/{o['p99']*1000:.0f}")
    return n, before, after


def _report(n: int, before: dict[str, Sample], after: dict[str, Sample]) -> None:
    print("| process | threads | voluntary cs / req | involuntary cs / req | CPU ms / req |")
    print("|---|---:|---:|---:|---:|")
    for key in sorted(after):
        a, b = after[key], before[key]
        print(f"| {key} | {a.threads} | {(a.voluntary - b.voluntary) / n:.1f} | "
              f"{(a.involuntary - b.involuntary) / n:.1f} | {(a.cpu_s - b.cpu_s) * 1000 / n:.2f} |")
    print("\nvoluntary switches per request by thread name:")
    for key in sorted(after):
        a, b = after[key], before[key]
        per = {c: (v - b.by_thread.get(c, 0)) / n for c, v in a.by_thread.items()}
        print(f"  {key}: " + ", ".join(f"{c} {v:.1f}" for c, v in sorted(per.items(), key=lambda x: -x[1]) if v >= 0.5))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--rate", type=float, default=14.0)
    p.add_argument("--strace", default="", help="child name to attach strace -c -f to (e.g. gateway-0)")
    p.add_argument("--pyspy", nargs="*", default=[], help="child names to sample with py-spy (collapsed stacks)")
    p.add_argument("--pyspy-bin", default="py-spy")
    p.add_argument("--short", action="store_true", help="issue 27's short-request closed loop (see above)")
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--warm-seconds", type=float, default=2.0)
    args = p.parse_args(argv)
    n, before, after = _run_short(args) if args.short else _run_all_fits(args)
    _report(max(n, 1), before, after)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
