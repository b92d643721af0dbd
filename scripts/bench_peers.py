"""Routers side by side over the SAME sim engines (BENCHMARKS.md, "Routers side by side").

Starts one mesh -- scheduler, N sim engines (each also serving its own
OpenAI HTTP endpoint and vLLM-named metrics), a gateway and Envoy -- with the
engines calibrated as Meta-Llama-3-8B on an A100 (config/sim-profiles/), then
drives one seeded shared-prefix workload (`kvmesh bench`'s generator and
client, services/bench/) through, in turn:

  kvmesh:<policy>   Envoy -> gateway -> scheduler with that placement policy
                    (the scheduler restarts between policies; engines and
                    gateways reconnect, as after any scheduler restart)
  sglang-router     PyPI sglang-router==0.3.2, --policy cache_aware
  vllm-router       PyPI vllm-router==0.1.17, --policy cache_aware
                    (both pointed at the engines' HTTP endpoints; installed
                    by scripts/setup_peers.sh into .venv-peers)

Every run sees the same arrivals, groups and questions; only a per-run salt at
the head of each shared context differs, so no run inherits another's cache.
Before each measured run, one unmeasured request per group (at its own
arrival time) warms the caches and the routers' prefix trees: the table is
steady state.
Then, optionally (--priority-rate), kvmesh's default policy under overload
with mixed priorities (X-Priority P0/P1/P2), to show P0 TTFT and aging.

    bash scripts/setup_peers.sh                                   # once: .venv-peers
    .venv/bin/python scripts/bench_peers.py                       # ~8 min on 2 cores
    .venv/bin/python scripts/bench_peers.py --targets kvmesh:round_robin sglang-router

Prints one table and writes JSON (--json). Not a test: it measures.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.bench.cli import bench, token_counter
from services.bench.report import format_summary
from services.bench.runner import Target, run_workload
from services.bench.workloads import (
    Arrival,
    ArrivalSpec,
    Conversation,
    WorkloadKind,
    WorkloadSpec,
    build_workload,
)
from services.common.config import MeshConfig, load_config
from services.common.proto.kvmesh.v1 import scheduler_pb2, scheduler_pb2_grpc
from services.engine.sim.profiles import apply_profile, load_profile
from services.launcher.mesh import Mesh, MeshOptions
from services.launcher.ports import free_port

MODEL = "tiny-llama"
POLICIES = ["round_robin", "least_load", "prefix_approx", "kv_precise", "sticky_until_saturated"]
PEERS = ["sglang-router", "vllm-router"]
PEER_BIN = ROOT / ".venv-peers" / "bin"


# ---------------------------------------------------------------- mesh


def mesh_config(args: argparse.Namespace) -> MeshConfig:
    config = load_config(ROOT / "config" / "kvmesh.yaml")
    apply_profile(config, load_profile(args.profile), speed_factor=args.speed_factor)
    t = config.engines.template
    if args.total_blocks:
        t.total_blocks = args.total_blocks
    if args.max_running:
        t.max_running = args.max_running
    for model in config.models:  # long shared contexts: past tiny-llama's 2048 positions
        if model.name == MODEL:
            model.max_model_len = args.max_model_len
    config.engines.http_base_port = 1      # non-zero = on; the launcher picks free ports
    config.scheduler.policy = "sticky_until_saturated"
    config.scheduler.metrics_port = 0
    config.gateway.metrics_port = 0
    config.gateway.max_generation_seconds = 600.0
    return config


def write_scheduler_config(mesh: Mesh, policy: str, aging_seconds: float | None) -> None:
    """Rewrite the mesh's resolved config the scheduler reads at start."""
    mesh.config.scheduler.policy = policy
    if aging_seconds:
        mesh.config.scheduler.aging.p1_seconds = aging_seconds
        mesh.config.scheduler.aging.p2_seconds = aging_seconds
    mesh.config_path.write_text("# Rewritten by scripts/bench_peers.py\n"
                                + yaml.safe_dump(dataclasses.asdict(mesh.config), sort_keys=False))


def wait_scheduler(mesh: Mesh, policy: str, engines: int, timeout: float = 60.0) -> None:
    """Until the (restarted) scheduler runs `policy` and every engine is back."""
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(mesh.endpoints.scheduler) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        while time.monotonic() < deadline:
            try:
                state = stub.GetState(scheduler_pb2.GetStateRequest(), timeout=5)
                fresh = sum(e.serving and e.fresh for e in state.engines)
                if state.policy == policy and fresh == engines:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    raise RuntimeError(f"scheduler did not come back with policy {policy} and {engines} engines")


def switch_policy(mesh: Mesh, policy: str, engines: int, aging_seconds: float | None = None) -> None:
    write_scheduler_config(mesh, policy, aging_seconds)
    mesh.restart("scheduler")
    wait_scheduler(mesh, policy, engines)
    time.sleep(1.0)  # gateways re-dial the scheduler with backoff


def engine_urls(mesh: Mesh) -> list[str]:
    return [f"http://127.0.0.1:{mesh.config.engine_config(i).http_port}" for i in range(mesh.config.engines.count)]


def engine_speeds(mesh: Mesh) -> str:
    """Each engine's measured prefill speed and step time (LoadReport 310-311) as the scheduler has them."""
    try:
        with grpc.insecure_channel(mesh.endpoints.scheduler) as channel:
            state = scheduler_pb2_grpc.SchedulerStub(channel).GetState(scheduler_pb2.GetStateRequest(), timeout=5)
    except grpc.RpcError as err:
        return f"(GetState failed: {err.code().name})"
    return " ".join(f"{e.prefill_tokens_per_second:.0f}/{e.step_seconds * 1000:.0f}" for e in state.engines)


def engine_successes(mesh: Mesh) -> list[int]:
    """Requests each engine has finished (its vllm:request_success_total)."""
    out = []
    for i in range(mesh.config.engines.count):
        port = mesh.config.engine_config(i).metrics_port
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            text = r.read().decode()
        out.append(round(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                             if line.startswith("vllm:request_success_total{"))))
    return out


# ---------------------------------------------------------------- peers


class Peer:
    """One peer router process (its own process group; stopped by its pid)."""

    def __init__(self, name: str, urls: list[str], log_dir: Path) -> None:
        self.name = name
        self.port = free_port()
        prom = free_port()
        if name == "sglang-router":
            argv = [str(PEER_BIN / "sglang-router"), "launch", "--host", "127.0.0.1", "--port", str(self.port),
                    "--worker-urls", *urls, "--policy", "cache_aware",
                    "--prometheus-host", "127.0.0.1", "--prometheus-port", str(prom)]
        else:
            argv = [str(PEER_BIN / "vllm-router"), "--host", "127.0.0.1", "--port", str(self.port),
                    "--worker-urls", *urls, "--policy", "cache_aware", "--prometheus-port", str(prom)]
        self.log = log_dir / f"{name}.log"
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        self.proc = subprocess.Popen(argv, stdout=self.log.open("wb"), stderr=subprocess.STDOUT,
                                     start_new_session=True, env=env)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "warm up"}],
                           "max_tokens": 2}).encode()
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited: {self.log.read_text()[-2000:]}")
            try:
                req = urllib.request.Request(self.url + "/v1/chat/completions", data=body,
                                             headers={"Content-Type": "application/json"})
                with urllib.request.urlopen(req, timeout=10) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} not ready after {timeout:.0f} s: {self.log.read_text()[-2000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


# ---------------------------------------------------------------- runs


def workload(args: argparse.Namespace, salt: str, kind: WorkloadKind = WorkloadKind.SHARED_PREFIX,
             requests: int | None = None) -> WorkloadSpec:
    return WorkloadSpec(kind, conversations=requests or args.requests, seed=args.seed, groups=args.groups,
                        context_tokens=args.context_tokens, max_tokens=args.max_tokens, salt=salt,
                        priority_mix=(0.2, 0.3, 0.5))


def warm_up(spec: WorkloadSpec, arrival: ArrivalSpec, target: Target, count: Any) -> None:
    """The first request of each group, at its own arrival time (open loop,
    like the run), not measured: every router starts the measured run having
    seen each group once, as a long-running deployment would, so the table is
    steady state rather than each group's first cold prefill. (A sequential
    warm-up is unfair to sglang-router: on idle workers it sends every new
    prefix to the same worker, BENCHMARKS.md.)"""
    firsts: dict[int, Conversation] = {}
    # Built with the run's own arrival spec: the generator draws arrivals
    # first, so another spec would draw other contexts.
    for conv in build_workload(spec, arrival, count):
        firsts.setdefault(conv.group, conv)
    run = asyncio.run(run_workload(list(firsts.values()), arrival, target))
    failed = [r.error for r in run.results if not r.ok]
    if failed:
        raise RuntimeError(f"warm-up failed: {failed[:3]}")


def run_one(label: str, spec: WorkloadSpec, arrival: ArrivalSpec, target: Target, count: Any,
            mesh: Mesh, warm: bool = True) -> dict[str, Any]:
    if warm:
        warm_up(spec, arrival, target, count)
    before = engine_successes(mesh)
    run, summary = asyncio.run(bench(spec, arrival, target, count, label=label))
    after = engine_successes(mesh)
    summary["per_engine"] = [a - b for a, b in zip(after, before)]
    # Per request: [conversation, group, priority, start s, TTFT s, prompt tokens, cached tokens, status].
    summary["requests_detail"] = [[r.conversation, r.group, r.priority, round(r.start, 3),
                                   None if r.ttft is None else round(r.ttft, 4), r.prompt_tokens,
                                   r.cached_tokens, r.status] for r in run.results]
    summary["label"] = label
    print(f"\n{label}\n{format_summary(summary)}\nrequests per engine: {summary['per_engine']}\n"
          f"measured prefill tok/s / step ms per engine: {engine_speeds(mesh)}", file=sys.stderr, flush=True)
    return summary


def _ms(block: dict[str, Any], metric: str, p: str) -> float | None:
    v = block[metric].get(p)
    return None if v is None else v * 1000


def table(rows: list[dict[str, Any]]) -> str:
    head = ["router / policy", "ok", "TTFT p50 ms", "TTFT p90 ms", "TTFT p99 ms", "req/s", "out tok/s",
            "prefix hit rate", "requests per engine"]
    out = [head, ["---"] * len(head)]
    for s in rows:
        o = s["overall"]
        cell = lambda v: "-" if v is None else f"{v:.0f}"  # noqa: E731
        out.append([s["label"], f"{o['ok']}/{o['requests']}", cell(_ms(o, "ttft_s", "p50")),
                    cell(_ms(o, "ttft_s", "p90")), cell(_ms(o, "ttft_s", "p99")),
                    f"{o['requests_per_s']:.2f}", f"{o['output_tokens_per_s']:.0f}",
                    "-" if o["prefix_hit_rate"] is None else f"{o['prefix_hit_rate']:.1%}",
                    "/".join(str(n) for n in s["per_engine"])])
    return "\n".join("| " + " | ".join(r) + " |" for r in out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--targets", nargs="*", default=[*(f"kvmesh:{x}" for x in POLICIES), *PEERS])
    p.add_argument("--engines", type=int, default=8)
    p.add_argument("--profile", default=str(ROOT / "config" / "sim-profiles" / "llama3-8b-a100.yaml"))
    p.add_argument("--speed-factor", type=float, default=4.0,
                   help="sim cost multiplier (1 = the profile's A100); 4 keeps 2 shared cores ahead of the sim")
    p.add_argument("--total-blocks", type=int, default=640,
                   help="KV blocks per engine (0 = the profile's 29,206); small = cache pressure")
    p.add_argument("--max-running", type=int, default=0, help="0 = the profile's batch cap")
    p.add_argument("--groups", type=int, default=16)
    p.add_argument("--context-tokens", type=int, default=2000)
    p.add_argument("--max-model-len", type=int, default=16384)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--rate", type=float, default=14.0, help="Poisson arrivals per second")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--priority-rate", type=float, default=0.0,
                   help="then: kvmesh default policy, mixed priorities at this rate (0 = skip)")
    p.add_argument("--priority-requests", type=int, default=600)
    p.add_argument("--aging-seconds", type=float, default=10.0, help="aging for the priority run")
    p.add_argument("--priority-policy", default="sticky_until_saturated", help="kvmesh policy of the priority run")
    p.add_argument("--log-dir", default=str(ROOT / ".run" / "bench-peers"), help="peer routers' logs")
    p.add_argument("--json", default=str(ROOT / "artifacts" / "bench" / "peers.json"))
    args = p.parse_args(argv)

    count = token_counter(str(ROOT / ".models" / MODEL))
    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    arrival = ArrivalSpec(Arrival.POISSON, rate=args.rate)
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kvmesh-peers-") as tmp:
        mesh = Mesh(mesh_config(args), MeshOptions(engines=args.engines, backend="sim", model=MODEL,
                                                   free_ports=True, run_dir=Path(tmp)))
        print(f"starting a mesh with {args.engines} sim engines ...", file=sys.stderr, flush=True)
        mesh.start()
        peer: Peer | None = None
        try:
            kv_target = Target(mesh.endpoints.public_http, MODEL, mesh.api_key)
            policy = "sticky_until_saturated"
            for k, name in enumerate(args.targets):
                spec = workload(args, f"[run {k}] ")
                if name.startswith("kvmesh:"):
                    want = name.split(":", 1)[1]
                    if want != policy:
                        switch_policy(mesh, want, args.engines)
                        policy = want
                    results.append(run_one(name, spec, arrival, kv_target, count, mesh))
                else:
                    peer = Peer(name, engine_urls(mesh), log_dir)
                    peer.wait_ready()
                    results.append(run_one(name, spec, arrival, Target(peer.url, MODEL), count, mesh))
                    peer.stop()
                    peer = None
            priority: dict[str, Any] | None = None
            if args.priority_rate:
                switch_policy(mesh, args.priority_policy, args.engines, args.aging_seconds)
                spec = workload(args, "[priorities] ", WorkloadKind.MIXED_PRIORITY, args.priority_requests)
                priority = run_one(f"kvmesh:{args.priority_policy} mixed priorities @ {args.priority_rate}/s",
                                   spec, ArrivalSpec(Arrival.POISSON, rate=args.priority_rate), kv_target,
                                   count, mesh)
        finally:
            if peer is not None:
                peer.stop()
            mesh.stop_all()
    print(f"\n{args.engines} sim engines ({Path(args.profile).stem}, {args.total_blocks or 'profile'} blocks, "
          f"speed {args.speed_factor:g}); shared prefix: {args.groups} groups x {args.context_tokens} tokens, "
          f"{args.requests} requests, Poisson {args.rate}/s, max_tokens {args.max_tokens}, seed {args.seed}")
    print(table(results))
    if priority is not None:
        print(f"\n{priority['label']} (aging {args.aging_seconds:g} s per class)")
        print(format_summary(priority))
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "runs": results, "priority": priority}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
