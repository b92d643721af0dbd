"""Routers side by side over the SAME sim engines (BENCHMARKS.md, "Routers side by side").

Starts one mesh -- scheduler, N sim engines (each also serving its own
OpenAI HTTP endpoint and vLLM-named metrics), a gateway and Envoy -- with the
engines calibrated as Meta-Llama-3-8B on an A100 (config/sim-profiles/), then
drives each workload (`kvmesh bench`'s generator and client, services/bench/)
through, in turn:

  kvmesh:<policy>   Envoy -> gateway -> scheduler with that placement policy
                    (every built-in profile of services/scheduler/placement/
                    policies.py; the scheduler restarts before each run, as
                    after any scheduler restart: engines and gateways
                    reconnect, the KV index is rebuilt from the engines)
  smg               PyPI smg==1.13.0 (SGLang's gateway, sglang-router's
                    successor): `smg launch --worker-urls ... --policy
                    cache_aware --tokenizer-path .models/tiny-llama
                    --prometheus-host 127.0.0.1 --prometheus-port <free>`
  sglang-router     PyPI sglang-router==0.3.2, `launch ... --policy cache_aware`
  vllm-router       PyPI vllm-router==0.1.17, `--policy cache_aware`
                    (all three pointed at the engines' HTTP endpoints,
                    installed by scripts/setup_peers.sh into .venv-peers, run
                    with HF_HUB_OFFLINE=1 and otherwise their default flags;
                    each peer is a fresh process per run)

What smg asks of a worker (watched through a logging proxy, 2026-12-02): GET
/health, /server_info and /model_info at registration (it detects HTTP vs gRPC,
then reads `tokenizer_path` / `model_path` from /model_info and loads that
tokenizer -- here the local .models/tiny-llama, never the hub), then only
POST /v1/chat/completions (max_tokens sent as max_completion_tokens, plus
SGLang's sampling extensions, which the engine's parser ignores); no /get_load
polling with cache_aware (it counts its own in-flight requests per worker),
/health again every 60 s. Its cache_aware defaults are sglang-router's:
cache_threshold 0.3, balance_abs_threshold 64, balance_rel_threshold 1.5.

Workloads (--workloads, default both), each with its own arrivals, salt and
warm-up, one table each:

  all_fits        the shared-prefix setup of issue 8: --groups contexts of
                  --context-tokens, --requests at Poisson --rate; every
                  context fits in the fleet's KV (not in one engine's)
  cache_pressure  services/bench/workloads.py's CACHE_PRESSURE shape (more
                  distinct contexts than the fleet's KV holds, Zipf group
                  popularity, multi-turn sessions that grow):
                  --pressure-requests sessions at Poisson --pressure-rate

Every run sees the same arrivals, groups and questions as the other runs of
its workload; only a per-run salt at the head of each shared context differs,
so no run inherits another's cache. Warm-up, unmeasured, before each run, with
the run's salt: all_fits -- the first request of each group at its own arrival
time (open loop, like the run; a sequential warm-up is unfair to sglang-router,
which then sends every new prefix to one idle worker, BENCHMARKS.md);
cache_pressure -- a shorter run of the same traffic, --pressure-warm sessions
(the same contexts: the workload draws them from their own seeded stream), so
the caches hold what this traffic keeps warm, as in a deployment that has been
running.

Floor (services/bench/floor.py, helper "pressure"): each run's own requests
(arrivals, the exact chats sent, output lengths; its warm-up's prompts cached
from the start) replayed in virtual time by the sim's cost model on an ideal
fleet -- the fleet's KV pooled across engines with Belady eviction
(kv_bounded=True, the tighter of its two bounds), every prefix cached where it
could be, oracle placement, no path cost. Every run gets its own floor (a replay costs ~0.5 s per 3,000 requests
plus tokenizing them, between measured runs; in the JSON as run["floor"]);
"x floor at p90" is the run's p90 over its own floor's p90; the floor row
shows the default policy's run's floor (the first target's if the default is
not among the targets; the runs' floors differ only by their salts' tokens).
Under each table, the default policy (config/kvmesh.yaml's scheduler.policy,
or --default-policy) against the best peer: the best peer p90 / kvmesh's p90
(> 1 = kvmesh better), the same at p99 (the peer best there), and req/s over
the best peer's.
Then, optionally (--priority-rate), kvmesh's default policy under overload
with mixed priorities (X-Priority P0/P1/P2), to show P0 TTFT and aging.

Several schedulers (--schedulers 1 2 3, issue 27; scripts/peerslib/replicas.py):
one mesh per count N, started as `kvmesh up --schedulers N` starts it (one
gateway: it spreads requests over the replicas by rendezvous hashing of the
request id), every kvmesh target run on each, the peers on the first mesh
only; each workload's table then gets a second one, TTFT p50/p90/p99 per N
and p90, p99 over the fewest N's, and a line per N saying whether both are
within 10%. --kvmesh-only leaves the peers out.

    bash scripts/setup_peers.sh                                   # once: .venv-peers
    .venv/bin/python scripts/bench_peers.py                       # every policy and peer, both workloads
    .venv/bin/python scripts/bench_peers.py --targets kvmesh:sticky_until_saturated smg sglang-router \\
        --workloads all_fits
    .venv/bin/python scripts/bench_peers.py --targets kvmesh:sticky_until_saturated --schedulers 1 2 3 \\
        --workloads all_fits

Prints one table per workload and writes JSON (--json). Not a test: it measures.
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
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scripts.peerslib.replicas import (
    add_arguments,
    kvmesh_label,
    mesh_runs,
    ratio_table,
    scheduler_names,
    settle_arguments,
    verdicts,
)
from services.bench.cli import bench, token_counter
from services.bench.floor import floor_summary
from services.bench.report import format_summary
from services.bench.runner import Target, run_workload
from services.bench.stats import RequestResult
from services.bench.workloads import (
    CACHE_PRESSURE_RATE,
    Arrival,
    ArrivalSpec,
    Conversation,
    TokenCounter,
    WorkloadKind,
    WorkloadSpec,
    build_workload,
    spec_for,
)
from services.common.config import MeshConfig, load_config
from services.common.proto.kvmesh.v1 import scheduler_pb2, scheduler_pb2_grpc
from services.engine.sim.profiles import apply_profile, load_profile
from services.launcher.mesh import Mesh, MeshOptions
from services.launcher.ports import free_port
from services.scheduler.placement.policies import builtin_profiles

MODEL = "tiny-llama"
MODEL_DIR = ROOT / ".models" / MODEL
# Every built-in placement profile: a policy added to builtin_profiles() is benchmarked without editing this.
POLICIES = list(builtin_profiles())
PEERS = ["smg", "sglang-router", "vllm-router"]
WORKLOADS = ["all_fits", "cache_pressure"]
PEER_BIN = ROOT / ".venv-peers" / "bin"
CONFIG_DEFAULT_POLICY = load_config(ROOT / "config" / "kvmesh.yaml").scheduler.policy


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
    config.scheduler.policy = getattr(args, "default_policy", CONFIG_DEFAULT_POLICY)  # other scripts pass fewer args
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


def wait_scheduler(address: str, policy: str, engines: int, timeout: float = 60.0) -> None:
    """Until the (restarted) scheduler replica at `address` runs `policy` and every engine is back."""
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(address) as channel:
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
    raise RuntimeError(f"scheduler {address} did not come back with policy {policy} and {engines} engines")


def switch_policy(mesh: Mesh, policy: str, engines: int, aging_seconds: float | None = None) -> None:
    """Every scheduler replica restarted with `policy` (all of them: a
    request's owner is any one, so a mesh never runs two policies)."""
    write_scheduler_config(mesh, policy, aging_seconds)
    for name in scheduler_names(mesh.options.schedulers):
        mesh.restart(name)
    for address in mesh.endpoints.schedulers:
        wait_scheduler(address, policy, engines)
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


def peer_argv(name: str, port: int, prom: int, urls: list[str]) -> list[str]:
    """Each peer's command line: cache_aware, its defaults otherwise, its
    Prometheus listener on a free loopback port (the defaults, 29000, would
    collide between peers and with other runs on the machine)."""
    if name == "smg":
        # --tokenizer-path: smg would otherwise load the path the workers'
        # /model_info names (the same local directory); never the hub.
        return [str(PEER_BIN / "smg"), "launch", "--host", "127.0.0.1", "--port", str(port),
                "--worker-urls", *urls, "--policy", "cache_aware", "--tokenizer-path", str(MODEL_DIR),
                "--prometheus-host", "127.0.0.1", "--prometheus-port", str(prom)]
    if name == "sglang-router":
        return [str(PEER_BIN / "sglang-router"), "launch", "--host", "127.0.0.1", "--port", str(port),
                "--worker-urls", *urls, "--policy", "cache_aware",
                "--prometheus-host", "127.0.0.1", "--prometheus-port", str(prom)]
    if name == "vllm-router":
        return [str(PEER_BIN / "vllm-router"), "--host", "127.0.0.1", "--port", str(port),
                "--worker-urls", *urls, "--policy", "cache_aware", "--prometheus-port", str(prom)]
    raise ValueError(f"unknown peer {name!r}; known: {PEERS}")


class Peer:
    """One peer router process (its own process group; stopped by its pid)."""

    def __init__(self, name: str, urls: list[str], log_dir: Path) -> None:
        self.name = name
        self.port = free_port()
        self.argv = peer_argv(name, self.port, free_port(), urls)
        self.log = log_dir / f"{name}.log"
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        self.proc = subprocess.Popen(self.argv, stdout=self.log.open("wb"), stderr=subprocess.STDOUT,
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


# ---------------------------------------------------------------- workloads


# The conversations of a run's unmeasured warm-up, from the run's own spec and arrivals.
WarmUp = Callable[[WorkloadSpec, ArrivalSpec, TokenCounter | None], list[Conversation]]


@dataclasses.dataclass(frozen=True)
class Workload:
    """One workload of the run: its spec for a salt, its arrivals, its warm-up."""

    name: str
    spec: Callable[[str], WorkloadSpec]
    arrival: ArrivalSpec
    warm: WarmUp
    describe: str


def firsts_at_own_time(spec: WorkloadSpec, arrival: ArrivalSpec, count: TokenCounter | None) -> list[Conversation]:
    """The first conversation of each group, at its own arrival time. Built
    with the run's own arrival spec: the generator draws arrivals first, so
    another spec would draw other contexts."""
    firsts: dict[int, Conversation] = {}
    for conv in build_workload(spec, arrival, count):
        firsts.setdefault(conv.group, conv)
    return list(firsts.values())


def shorter_run(sessions: int) -> WarmUp:
    """The workload's first `sessions` sessions' worth of the same traffic
    (same contexts and salt, same rate; CACHE_PRESSURE draws its contexts
    from their own seeded stream, so fewer sessions warm the same ones):
    the caches then hold what this traffic keeps warm, the popular head
    more than the tail, as in a deployment that has been running."""
    def warm(spec: WorkloadSpec, arrival: ArrivalSpec, count: TokenCounter | None) -> list[Conversation]:
        return build_workload(dataclasses.replace(spec, conversations=sessions), arrival, count)
    return warm


def all_fits(args: argparse.Namespace) -> Workload:
    def spec(salt: str) -> WorkloadSpec:
        return WorkloadSpec(WorkloadKind.SHARED_PREFIX, conversations=args.requests, seed=args.seed,
                            groups=args.groups, context_tokens=args.context_tokens,
                            max_tokens=args.max_tokens, salt=salt)
    return Workload("all_fits", spec, ArrivalSpec(Arrival.POISSON, rate=args.rate), firsts_at_own_time,
                    f"shared prefix: {args.groups} groups x {args.context_tokens} tokens, {args.requests} "
                    f"requests, Poisson {args.rate:g}/s, max_tokens {args.max_tokens}")


def cache_pressure(args: argparse.Namespace) -> Workload:
    rate = args.pressure_rate or CACHE_PRESSURE_RATE

    def spec(salt: str) -> WorkloadSpec:  # the kind's own benchmark shape (services/bench/workloads.py)
        return spec_for(WorkloadKind.CACHE_PRESSURE, args.pressure_requests, seed=args.seed, salt=salt)
    s = spec("")
    return Workload("cache_pressure", spec, ArrivalSpec(Arrival.POISSON, rate=rate),
                    shorter_run(args.pressure_warm),
                    f"cache pressure: {s.groups} groups x {s.context_tokens} tokens +- {s.context_spread:.0%}, "
                    f"Zipf {s.zipf:g}, {args.pressure_requests} sessions x {s.turns} turns (think "
                    f"{s.think_seconds:g} s), Poisson {rate:g} sessions/s, max_tokens {s.max_tokens}, "
                    f"warm-up {args.pressure_warm} sessions")


# ---------------------------------------------------------------- runs


def warm_up(workload: Workload, spec: WorkloadSpec, target: Target,
            count: TokenCounter | None) -> list[RequestResult]:
    """Unmeasured: the workload's warm-up requests (module docstring)."""
    run = asyncio.run(run_workload(workload.warm(spec, workload.arrival, count), workload.arrival, target))
    failed = [r.error for r in run.results if not r.ok]
    if failed:
        raise RuntimeError(f"warm-up failed: {failed[:3]}")
    return run.results


@dataclasses.dataclass
class Measured:
    summary: dict[str, Any]
    results: list[RequestResult]
    warm: list[RequestResult]


def run_one(label: str, workload: Workload, spec: WorkloadSpec, target: Target, count: TokenCounter | None,
            mesh: Mesh) -> Measured:
    warm = warm_up(workload, spec, target, count)
    before = engine_successes(mesh)
    run, summary = asyncio.run(bench(spec, workload.arrival, target, count, label=label))
    after = engine_successes(mesh)
    summary["per_engine"] = [a - b for a, b in zip(after, before)]
    # Per request: [conversation, turn, group, priority, start s, TTFT s, prompt tokens, cached tokens, status].
    summary["requests_detail"] = [[r.conversation, r.turn, r.group, r.priority, round(r.start, 3),
                                   None if r.ttft is None else round(r.ttft, 4), r.prompt_tokens,
                                   r.cached_tokens, r.status] for r in run.results]
    summary["label"] = label
    summary["workload"] = workload.name
    print(f"\n{label} [{workload.name}]\n{format_summary(summary)}\nrequests per engine: {summary['per_engine']}\n"
          f"measured prefill tok/s / step ms per engine: {engine_speeds(mesh)}", file=sys.stderr, flush=True)
    return Measured(summary, run.results, warm)


def floor_of(m: Measured, mesh: Mesh) -> dict[str, Any]:
    """services/bench/floor.py's floor of this run's own requests (its
    warm-up's prompts cached from the start, as on the real fleet), on the
    fleet's own KV pooled (kv_bounded: the tighter bound); a virtual-time
    replay, run between measured runs."""
    return floor_summary(m.results, mesh.config.engines.template, mesh.config.engines.count, MODEL_DIR, m.warm,
                         kv_bounded=True)


def _ms(block: dict[str, Any] | None, p: str) -> float | None:
    if block is None:
        return None
    v = block["ttft_s"].get(p)
    return None if v is None else v * 1000


def _cell(v: float | None, fmt: str = "{:.0f}") -> str:
    return "-" if v is None else fmt.format(v)


def table(rows: list[dict[str, Any]], floor_from: str) -> str:
    """One row per run (its "x floor" against its own requests' floor), then
    the floor row of `floor_from`'s run."""
    head = ["router / policy", "ok", "TTFT p50 ms", "TTFT p90 ms", "TTFT p99 ms", "req/s", "out tok/s",
            "prefix hit rate", "requests per engine", "x floor at p90"]
    out = [head, ["---"] * len(head)]
    for s in rows:
        o, p90, floor_p90 = s["overall"], _ms(s["overall"], "p90"), _ms(s["floor"], "p90")
        x = None if p90 is None or not floor_p90 else p90 / floor_p90
        out.append([s["label"], f"{o['ok']}/{o['requests']}", _cell(_ms(o, "p50")), _cell(p90),
                    _cell(_ms(o, "p99")), f"{o['requests_per_s']:.2f}", f"{o['output_tokens_per_s']:.0f}",
                    _cell(o["prefix_hit_rate"], "{:.1%}"), "/".join(str(n) for n in s["per_engine"]),
                    _cell(x, "{:.2f}x")])
    floor = next((s["floor"] for s in rows if s["label"] == floor_from), None)
    if floor is not None:
        out.append([f"floor (replay of {floor_from}'s requests)", f"{floor['ok']}/{floor['requests']}",
                    _cell(_ms(floor, "p50")), _cell(_ms(floor, "p90")), _cell(_ms(floor, "p99")),
                    _cell(floor["requests_per_s"], "{:.2f}"), _cell(floor["output_tokens_per_s"]),
                    _cell(floor["prefix_hit_rate"], "{:.1%}"), "/".join(str(n) for n in floor["per_engine"]),
                    "1.00x"])
    return "\n".join("| " + " | ".join(r) + " |" for r in out)


def versus_best_peer(rows: list[dict[str, Any]], default_label: str) -> dict[str, Any] | None:
    """The default policy against the best peer at p90, at p99 (each the
    peer best there) and in throughput; ratios > 1 = kvmesh better."""
    mine = next((s for s in rows if s["label"] == default_label), None)
    peers = [s for s in rows if not s["label"].startswith("kvmesh:") and s["overall"]["ok"]]
    if mine is None or not peers:
        return None
    out: dict[str, Any] = {"default": default_label}
    for p in ("p90", "p99"):
        best = min(peers, key=lambda s: _ms(s["overall"], p) or float("inf"))
        theirs, ours = _ms(best["overall"], p), _ms(mine["overall"], p)
        out[p] = {"peer": best["label"], "peer_ms": theirs, "kvmesh_ms": ours,
                  "better_x": None if not theirs or not ours else theirs / ours}
    best = max(peers, key=lambda s: s["overall"]["requests_per_s"])
    out["throughput"] = {"peer": best["label"], "peer_req_s": best["overall"]["requests_per_s"],
                         "kvmesh_req_s": mine["overall"]["requests_per_s"],
                         "x": mine["overall"]["requests_per_s"] / best["overall"]["requests_per_s"]}
    return out


def versus_lines(v: dict[str, Any] | None) -> str:
    if v is None:
        return "(no default-policy run or no peer run: no ratio)"
    lines = [f"{v['default']} (default) vs the best peer:"]
    for p in ("p90", "p99"):
        r = v[p]
        lines.append(f"  TTFT {p}: {r['peer']} {_cell(r['peer_ms'])} ms / kvmesh {_cell(r['kvmesh_ms'])} ms = "
                     f"{_cell(r['better_x'], '{:.2f}')}x better")
    t = v["throughput"]
    lines.append(f"  throughput: kvmesh {t['kvmesh_req_s']:.2f} req/s vs {t['peer']} {t['peer_req_s']:.2f} "
                 f"= {t['x']:.3f}x")
    return "\n".join(lines)


# ---------------------------------------------------------------- main


class Bench:
    """The mesh, the current router state, and every run's results."""

    def __init__(self, args: argparse.Namespace, mesh: Mesh, count: TokenCounter | None) -> None:
        self.args = args
        self.mesh = mesh
        self.schedulers = mesh.options.schedulers
        self.count = count
        self.kv_target = Target(mesh.endpoints.public_http, MODEL, mesh.api_key)
        self.fresh_scheduler = True   # just started with args.default_policy
        self.runs = 0
        self.peer: Peer | None = None

    def run_target(self, name: str, workload: Workload) -> Measured:
        """One measured run of `name` on `workload`, on a fresh router: a
        restarted scheduler or a new peer process (no state from a run before)."""
        spec = workload.spec(f"[run {self.runs}] ")
        self.runs += 1
        if name.startswith("kvmesh:"):
            policy = name.split(":", 1)[1]
            if not (self.fresh_scheduler and policy == self.args.default_policy):
                switch_policy(self.mesh, policy, self.args.engines)
            self.fresh_scheduler = False
            m = run_one(kvmesh_label(policy, self.schedulers), workload, spec, self.kv_target, self.count,
                        self.mesh)
            m.summary.update(policy=policy, schedulers=self.schedulers)
            return m
        self.peer = Peer(name, engine_urls(self.mesh), Path(self.args.log_dir))
        try:
            self.peer.wait_ready()
            return run_one(name, workload, spec, Target(self.peer.url, MODEL), self.count, self.mesh)
        finally:
            self.peer.stop()
            self.peer = None

    def run_workload(self, workload: Workload, targets: list[str]) -> list[dict[str, Any]]:
        """One run of each target on this mesh, with its floor."""
        rows: list[dict[str, Any]] = []
        for name in targets:
            m = self.run_target(name, workload)
            m.summary["floor"] = floor_of(m, self.mesh)  # cheap: virtual time, between measured runs
            rows.append(m.summary)
        return rows

    def priority_run(self) -> dict[str, Any]:
        args = self.args
        switch_policy(self.mesh, args.default_policy, args.engines, args.aging_seconds)
        spec = WorkloadSpec(WorkloadKind.MIXED_PRIORITY, conversations=args.priority_requests, seed=args.seed,
                            groups=args.groups, context_tokens=args.context_tokens, max_tokens=args.max_tokens,
                            salt="[priorities] ", priority_mix=(0.2, 0.3, 0.5))
        arrival = ArrivalSpec(Arrival.POISSON, rate=args.priority_rate)
        workload = Workload("mixed_priority", lambda _salt: spec, arrival, firsts_at_own_time, "")
        return run_one(f"kvmesh:{args.default_policy} mixed priorities @ {args.priority_rate}/s",
                             workload, spec, self.kv_target, self.count, self.mesh).summary


def workload_table(workload: Workload, rows: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    """One workload's runs over every mesh: the floor row from the default
    policy's run with the first scheduler count (else the first run), and
    that run against the best peer."""
    default = kvmesh_label(args.default_policy, args.schedulers[0])
    labels = [s["label"] for s in rows]
    floor_from = default if default in labels else labels[0]
    return {"name": workload.name, "describe": workload.describe, "runs": rows, "floor_from": floor_from,
            "floor": next(s["floor"] for s in rows if s["label"] == floor_from),
            "versus": versus_best_peer(rows, default)}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--targets", nargs="*", default=[*(f"kvmesh:{x}" for x in POLICIES), *PEERS],
                   help=f"kvmesh:<policy> ({', '.join(POLICIES)}) and peers ({', '.join(PEERS)})")
    add_arguments(p)
    p.add_argument("--workloads", nargs="*", default=list(WORKLOADS), choices=WORKLOADS)
    p.add_argument("--default-policy", default=CONFIG_DEFAULT_POLICY,
                   help="kvmesh's default policy: the one compared with the peers and run with priorities "
                        "(default: config/kvmesh.yaml's scheduler.policy)")
    p.add_argument("--engines", type=int, default=8)
    p.add_argument("--profile", default=str(ROOT / "config" / "sim-profiles" / "llama3-8b-a100.yaml"))
    p.add_argument("--speed-factor", type=float, default=4.0,
                   help="sim cost multiplier (1 = the profile's A100); 4 keeps 2 shared cores ahead of the sim")
    p.add_argument("--total-blocks", type=int, default=640,
                   help="KV blocks per engine (0 = the profile's 29,206); small = cache pressure")
    p.add_argument("--max-running", type=int, default=0, help="0 = the profile's batch cap")
    p.add_argument("--max-model-len", type=int, default=16384)
    g = p.add_argument_group("all_fits")
    g.add_argument("--groups", type=int, default=16)
    g.add_argument("--context-tokens", type=int, default=2000)
    g.add_argument("--max-tokens", type=int, default=16)
    g.add_argument("--requests", type=int, default=300)
    g.add_argument("--rate", type=float, default=14.0, help="Poisson arrivals per second")
    g = p.add_argument_group("cache_pressure (its shape: services/bench/workloads.py)")
    g.add_argument("--pressure-requests", type=int, default=150, help="sessions (each several turns)")
    g.add_argument("--pressure-rate", type=float, default=0.0,
                   help=f"Poisson sessions per second (0 = workloads.CACHE_PRESSURE_RATE, {CACHE_PRESSURE_RATE:g})")
    g.add_argument("--pressure-warm", type=int, default=40, help="sessions of the unmeasured warm-up run")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--priority-rate", type=float, default=0.0,
                   help="then: kvmesh default policy, mixed priorities at this rate (0 = skip)")
    p.add_argument("--priority-requests", type=int, default=600)
    p.add_argument("--aging-seconds", type=float, default=10.0, help="aging for the priority run")
    p.add_argument("--log-dir", default=str(ROOT / ".run" / "bench-peers"), help="peer routers' logs")
    p.add_argument("--json", default=str(ROOT / "artifacts" / "bench" / "peers.json"))
    args = p.parse_args(argv)
    for name in args.targets:
        if name.startswith("kvmesh:") or name in PEERS:
            continue
        p.error(f"unknown target {name!r}: kvmesh:<policy> or one of {PEERS}")
    settle_arguments(p, args)
    return args


def report(args: argparse.Namespace, tables: list[dict[str, Any]], priority: dict[str, Any] | None) -> None:
    print(f"\n{args.engines} sim engines ({Path(args.profile).stem}, {args.total_blocks or 'profile'} blocks, "
          f"speed {args.speed_factor:g}), seed {args.seed}")
    for t in tables:
        print(f"\n## {t['name']}: {t['describe']}\n")
        print(table(t["runs"], t["floor_from"]))
        print(versus_lines(t["versus"]))
        replicas = ratio_table(t["runs"])
        if replicas:
            print(f"\nscheduler replicas, TTFT against {min(args.schedulers)} scheduler(s):\n\n{replicas}")
            print("\n".join(verdicts(t["runs"])))
    if priority is not None:
        print(f"\n{priority['label']} (aging {args.aging_seconds:g} s per class)")
        print(format_summary(priority))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    count = token_counter(str(MODEL_DIR))
    Path(args.log_dir).mkdir(parents=True, exist_ok=True)
    makers = {"all_fits": all_fits, "cache_pressure": cache_pressure}
    workloads = [makers[name](args) for name in args.workloads]
    rows: dict[str, list[dict[str, Any]]] = {w.name: [] for w in workloads}
    priority: dict[str, Any] | None = None
    for i, run in enumerate(mesh_runs(args.schedulers, args.targets)):
        with tempfile.TemporaryDirectory(prefix="kvmesh-peers-") as tmp:
            mesh = Mesh(mesh_config(args), MeshOptions(engines=args.engines, backend="sim", model=MODEL,
                                                       schedulers=run.schedulers, free_ports=True,
                                                       run_dir=Path(tmp)))
            print(f"starting a mesh with {args.engines} sim engines and {run.schedulers} scheduler(s) ...",
                  file=sys.stderr, flush=True)
            mesh.start()
            b = Bench(args, mesh, count)
            try:
                for address in mesh.endpoints.schedulers:  # every replica sees the whole fleet before a run
                    wait_scheduler(address, args.default_policy, args.engines)
                for workload in workloads:
                    if run.targets:
                        rows[workload.name] += b.run_workload(workload, run.targets)
                if args.priority_rate and i == 0:
                    priority = b.priority_run()
            finally:
                if b.peer is not None:
                    b.peer.stop()
                mesh.stop_all()
    tables = [workload_table(w, rows[w.name], args) for w in workloads if rows[w.name]]
    report(args, tables, priority)
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "workloads": tables,
                               "runs": [r for t in tables for r in t["runs"]], "priority": priority}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
