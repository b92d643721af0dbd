"""Compare kvmesh's placement policies on one shared-prefix workload.

For each policy (round_robin, least_load, prefix_approx, kv_precise,
sticky_until_saturated) this starts a fresh mesh -- scheduler, N sim engines,
one gateway, Envoy, on free ports -- with `scheduler.policy` set, replays the
same seeded workload through Envoy's OpenAI endpoint, stops the mesh, and
finally prints one table:

    policy | ok | prefix hit rate | TTFT p50 / p99 | throughput

Workload: `--groups` groups, each with its own long system context (about
`--context-tokens` tokens; think "a document or a long agent prompt"), and
short per-request questions; each request picks a group uniformly at random;
arrivals are Poisson at `--rate` requests/s (open loop, so a slow policy builds
a queue instead of slowing the client down). Every request is a streamed chat
completion; TTFT is measured at the first SSE chunk carrying content, hit rate
is sum(usage.prompt_tokens_details.cached_tokens) / sum(usage.prompt_tokens).

Cost model: prefill dominates. The sim charges `--prefill-us` microseconds per
prompt token (100 us ~ an 8B model on an A100 at ~50% MFU, see
services/engine/sim/cost_model.py) and the default 8 ms per decode step, with
short answers (`--max-tokens`), so a cache hit saves most of a request's GPU
time. `--speed-factor 2` (the default) doubles every simulated cost and the
default rate is halved to match: the same simulated GPU utilisation with half
the CPU spent in the gateway, Envoy and this client, which share two cores
with the engines. Engines are small (`--total-blocks`): one engine's cache holds only a few
of the group contexts, so where a policy sends each group decides its hit rate.

    .venv/bin/python scripts/scenario_policies.py            # all policies, ~3 min
    .venv/bin/python scripts/scenario_policies.py --policies round_robin sticky_until_saturated

Not a test: it measures. Results depend on the machine; BENCHMARKS.md keeps a run.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import random
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.bench.sse import SseEvents
from services.bench.stats import percentile
from services.common.config import MeshConfig, load_config
from services.launcher.mesh import Mesh, MeshOptions

POLICIES = ["round_robin", "least_load", "prefix_approx", "kv_precise", "sticky_until_saturated"]
MODEL = "tiny-llama"
_WORDS = (
    "the system shall answer every question about the attached contract using only its clauses "
    "cite section numbers quote exact figures and refuse to speculate when the document is silent "
    "river mountain ledger invoice parcel harbor customs tariff warranty liability indemnity "
    "schedule appendix delivery acceptance payment interest penalty termination renewal notice "
    "supplier customer carrier insurer auditor regulator tribunal venue governing law clause"
).split()


@dataclass(frozen=True)
class Request:
    at: float          # seconds after the start
    group: int
    system: str
    question: str


@dataclass
class Outcome:
    ok: bool
    ttft: float = 0.0
    latency: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    error: str = ""


@dataclass
class PolicyResult:
    policy: str
    outcomes: list[Outcome] = field(default_factory=list)
    makespan: float = 0.0
    per_engine: dict[str, int] = field(default_factory=dict)

    def row(self) -> list[str]:
        ok = [o for o in self.outcomes if o.ok]
        prompt = sum(o.prompt_tokens for o in ok)
        cached = sum(o.cached_tokens for o in ok)
        ttfts = sorted(o.ttft for o in ok)
        tokens = sum(o.completion_tokens for o in ok)
        spread = "/".join(str(self.per_engine[k]) for k in sorted(self.per_engine))
        return [
            self.policy,
            f"{len(ok)}/{len(self.outcomes)}",
            f"{cached / prompt:.1%}" if prompt else "-",
            f"{percentile(ttfts, 50) * 1000:.0f}" if ttfts else "-",
            f"{percentile(ttfts, 99) * 1000:.0f}" if ttfts else "-",
            f"{len(ok) / self.makespan:.2f}" if self.makespan else "-",
            f"{tokens / self.makespan:.0f}" if self.makespan else "-",
            spread,
        ]


# ---------------------------------------------------------------- workload


def build_workload(args: argparse.Namespace) -> list[Request]:
    """Seeded: the same requests, groups and arrival times for every policy."""
    from tokenizers import Tokenizer  # only the script needs it here

    tokenizer = Tokenizer.from_file(str(ROOT / ".models" / MODEL / "tokenizer.json"))
    rng = random.Random(args.seed)
    systems = []
    for g in range(args.groups):
        words = [f"Group {g} reference document {rng.randrange(10**6)}."]
        while len(tokenizer.encode(" ".join(words)).ids) < args.context_tokens:
            words.extend(rng.choice(_WORDS) for _ in range(32))
        systems.append(" ".join(words))
    requests, t = [], 0.0
    for i in range(args.requests):
        t += rng.expovariate(args.rate)
        group = rng.randrange(args.groups)
        question = f"Question {i}: " + " ".join(rng.choice(_WORDS) for _ in range(12)) + "?"
        requests.append(Request(t, group, systems[group], question))
    return requests


# ---------------------------------------------------------------- mesh


def mesh_config(args: argparse.Namespace, policy: str) -> MeshConfig:
    config = load_config(ROOT / "config" / "kvmesh.yaml")
    t = config.engines.template
    t.total_blocks = args.total_blocks
    t.max_running = args.max_running
    t.sim.prefill_seconds_per_token = args.prefill_us / 1e6
    t.sim.speed_factor = args.speed_factor
    config.scheduler.policy = policy
    # The scheduler turns an engine's queued prompt tokens into seconds with
    # this estimate; tell it the engines' real prefill speed, as an operator
    # would (its default, 20k tok/s, matches the sim's default 50 us/token).
    config.scheduler.prefill_tokens_per_second = 1e6 / (args.prefill_us * max(args.speed_factor, 1e-9))
    config.scheduler.metrics_port = 0
    config.gateway.metrics_port = 0
    return config


async def one_request(
    session: aiohttp.ClientSession, url: str, key: str, req: Request, max_tokens: int, t0: float
) -> Outcome:
    delay = t0 + req.at - time.monotonic()
    if delay > 0:
        await asyncio.sleep(delay)
    body = {
        "model": MODEL, "max_tokens": max_tokens, "stream": True,
        "stream_options": {"include_usage": True},
        "messages": [{"role": "system", "content": req.system}, {"role": "user", "content": req.question}],
    }
    sent = time.monotonic()
    ttft = None
    usage: dict = {}
    try:
        async with session.post(url, json=body, headers={"Authorization": f"Bearer {key}"}) as resp:
            if resp.status != 200:
                return Outcome(False, error=f"HTTP {resp.status}: {(await resp.text())[:200]}")
            async for event in SseEvents(resp.content):
                if "error" in event:
                    return Outcome(False, error=str(event["error"])[:200])
                if ttft is None and any(c.get("delta", {}).get("content") for c in event.get("choices", [])):
                    ttft = time.monotonic() - sent
                if event.get("usage"):
                    usage = event["usage"]
    except (TimeoutError, aiohttp.ClientError) as exc:
        return Outcome(False, error=repr(exc))
    if ttft is None or not usage:
        return Outcome(False, error="stream ended without content or usage")
    return Outcome(
        True, ttft=ttft, latency=time.monotonic() - sent,
        prompt_tokens=usage["prompt_tokens"],
        cached_tokens=usage.get("prompt_tokens_details", {}).get("cached_tokens", 0),
        completion_tokens=usage["completion_tokens"],
    )


def engine_requests(mesh: Mesh) -> dict[str, int]:
    """Requests each engine finished (its vllm:request_success_total)."""
    import urllib.request

    out = {}
    for i in range(mesh.config.engines.count):
        engine = mesh.config.engine_config(i)
        with urllib.request.urlopen(f"http://127.0.0.1:{engine.metrics_port}/metrics", timeout=10) as r:
            text = r.read().decode()
        out[engine.engine_id] = round(sum(
            float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith("vllm:request_success_total{")
        ))
    return out


async def drive(mesh: Mesh, workload: list[Request], max_tokens: int) -> tuple[list[Outcome], float]:
    url = f"{mesh.endpoints.public_http}/v1/chat/completions"
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:
        t0 = time.monotonic()
        outcomes = await asyncio.gather(*(one_request(session, url, mesh.api_key, r, max_tokens, t0)
                                          for r in workload))
        return list(outcomes), time.monotonic() - t0


def run_policy(args: argparse.Namespace, policy: str, workload: list[Request], run_dir: Path) -> PolicyResult:
    mesh = Mesh(mesh_config(args, policy), MeshOptions(
        engines=args.engines, backend="sim", model=MODEL, free_ports=True, run_dir=run_dir / policy))
    mesh.start()
    try:
        outcomes, makespan = asyncio.run(drive(mesh, workload, args.max_tokens))
        per_engine = engine_requests(mesh)
    finally:
        mesh.stop_all()
    result = PolicyResult(policy, outcomes, makespan, per_engine)
    errors = Counter(o.error for o in outcomes if not o.ok)
    for error, n in errors.most_common(3):
        print(f"  {policy}: {n} x {error}", file=sys.stderr)
    return result


# ---------------------------------------------------------------- output

HEADER = ["policy", "ok", "prefix hit rate", "TTFT p50 ms", "TTFT p99 ms", "req/s", "out tok/s",
          "requests per engine"]


def table(results: list[PolicyResult]) -> str:
    rows = [HEADER, ["---"] * len(HEADER), *(r.row() for r in results)]
    return "\n".join("| " + " | ".join(row) + " |" for row in rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--policies", nargs="+", default=POLICIES, choices=POLICIES)
    p.add_argument("--engines", type=int, default=4)
    p.add_argument("--groups", type=int, default=8, help="distinct shared contexts")
    p.add_argument("--context-tokens", type=int, default=1500, help="tokens of each shared context")
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--rate", type=float, default=15.0, help="Poisson arrivals per second")
    p.add_argument("--max-tokens", type=int, default=8, help="answer length (short: prefill dominates)")
    p.add_argument("--prefill-us", type=float, default=100.0, help="sim microseconds per prompt token")
    p.add_argument("--speed-factor", type=float, default=2.0, help="sim cost multiplier")
    p.add_argument("--total-blocks", type=int, default=400, help="KV blocks (16 tokens) per engine")
    p.add_argument("--max-running", type=int, default=16, help="running sequences per engine")
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)

    workload = build_workload(args)
    print(f"workload: {args.requests} requests, {args.groups} groups x ~{args.context_tokens}-token "
          f"context, Poisson {args.rate}/s, max_tokens {args.max_tokens}; {args.engines} sim engines "
          f"({args.total_blocks} blocks x 16 tokens, max_running {args.max_running}, prefill "
          f"{args.prefill_us:g} us/token, speed {args.speed_factor:g}); seed {args.seed}", flush=True)
    results = []
    with tempfile.TemporaryDirectory(prefix="kvmesh-scenario-") as tmp:
        for policy in args.policies:
            started = time.monotonic()
            results.append(run_policy(args, policy, workload, Path(tmp)))
            print(f"  {policy}: done in {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
    print(table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
