"""`kvmesh bench`: drive a seeded workload against any OpenAI-compatible
endpoint and report TTFT / inter-token / end-to-end percentiles, throughput,
prefix hit rate and rejections, overall and per priority class.

    kvmesh bench --url http://127.0.0.1:8080 --api-key KEY --workload shared_prefix \
        --requests 200 --arrival poisson --rate 8 --tokenizer .models/tiny-llama \
        --json out.json --chart out.png

    kvmesh bench --workload cache_pressure --requests 150 --tokenizer .models/tiny-llama \
        --floor-profile config/sim-profiles/llama3-8b-a100.yaml --floor-engines 8 --floor-speed-factor 4

prints the run and its floor (services/bench/floor.py: the same requests on
ideal sim engines of that profile). `bench(...)` is the same run for scripts
(scripts/bench_peers.py).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from services.bench.workloads import (
    CACHE_PRESSURE_RATE,
    Arrival,
    ArrivalSpec,
    TokenCounter,
    WorkloadKind,
    WorkloadSpec,
    build_workload,
    spec_for,
)

if TYPE_CHECKING:  # aiohttp and the rest load only when a benchmark runs (kvmesh --help stays fast)
    from services.bench.runner import RunResult, Target

__all__ = ["add_parser", "bench", "token_counter"]


def token_counter(tokenizer_dir: str | None) -> TokenCounter | None:
    """len(tokens) with the model's tokenizer.json, or None (words stand in)."""
    if not tokenizer_dir:
        return None
    from tokenizers import Tokenizer  # only when asked

    tok = Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json"))
    return lambda text: len(tok.encode(text, add_special_tokens=False).ids)


async def bench(
    spec: WorkloadSpec, arrival: ArrivalSpec, target: Target, count_tokens: TokenCounter | None = None,
    label: str = "bench", show_progress: bool = True, scheduler: str | None = None,
) -> tuple[RunResult, dict[str, Any]]:
    """Build the workload, run it, summarize it. With `scheduler` (a kvmesh
    scheduler's gRPC address) the summary also gets `scheduler_classes`: the
    per-class preemptions, re-queues and time lost during the run (GetState
    before and after; {} when the scheduler reports none)."""
    from services.bench.progress import ProgressBar
    from services.bench.runner import run_workload
    from services.bench.scheduler_classes import class_deltas, read_classes
    from services.bench.stats import summarize

    conversations = build_workload(spec, arrival, count_tokens)
    total = sum(len(c.turns) for c in conversations)
    bar = ProgressBar(total, label) if show_progress else None
    before = await asyncio.to_thread(read_classes, scheduler) if scheduler else {}
    run = await run_workload(conversations, arrival, target, progress=bar)
    if bar is not None:
        bar.close()
    summary = summarize(run.results, run.duration)
    if scheduler:
        summary["scheduler_classes"] = class_deltas(before, await asyncio.to_thread(read_classes, scheduler))
    return run, summary


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser("bench", help="load-test an OpenAI-compatible endpoint (kvmesh or another router)",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8080", help="base URL (without /v1)")
    p.add_argument("--api-key", default=os.environ.get("KVMESH_API_KEY", ""))
    p.add_argument("--model", help="model name (default: the first of GET /v1/models)")
    p.add_argument("--path", default="/v1/chat/completions")
    p.add_argument("--header", action="append", default=[], metavar="NAME:VALUE", help="extra header")
    p.add_argument("--workload", choices=[k.value for k in WorkloadKind], default="shared_prefix")
    p.add_argument("--requests", type=int, default=100, help="conversations (requests for one-turn kinds)")
    p.add_argument("--arrival", choices=[a.value for a in Arrival], default="poisson")
    p.add_argument("--rate", type=float, help=f"open loop: conversations per second (default 8; "
                   f"cache_pressure {CACHE_PRESSURE_RATE:g})")
    p.add_argument("--gamma-shape", type=float, default=1.0, help="gamma arrivals: shape (CV = 1/sqrt)")
    p.add_argument("--concurrency", type=int, default=8, help="closed loop: conversations in flight")
    p.add_argument("--seed", type=int, default=1)
    # Unset = the workload's own default (services/bench/workloads.py: 8 groups x 1500 tokens, 16 words,
    # 16 tokens, 4 turns, 0 s; cache_pressure: 64 x 3000 +- 1/3, 24 words, 32 tokens, 4 turns, 1 s).
    p.add_argument("--groups", type=int)
    p.add_argument("--context-tokens", type=int)
    p.add_argument("--context-spread", type=float, help="cache_pressure: context lengths tokens x (1 +- spread)")
    p.add_argument("--zipf", type=float, help="cache_pressure: group k drawn with weight k**-zipf (0.8)")
    p.add_argument("--question-words", type=int)
    p.add_argument("--max-tokens", type=int)
    p.add_argument("--turns", type=int)
    p.add_argument("--think-seconds", type=float)
    p.add_argument("--long-fraction", type=float, default=0.3)
    p.add_argument("--long-max-tokens", type=int, default=512)
    p.add_argument("--priority-mix", default="0.2,0.3,0.5", help="P0,P1,P2 fractions (mixed_priority)")
    p.add_argument("--priority-in-body", action="store_true", help="also send vLLM's body field `priority`")
    p.add_argument("--tokenizer", help="model dir with tokenizer.json: exact context lengths")
    p.add_argument("--scheduler", metavar="HOST:PORT",
                   help="a kvmesh scheduler's gRPC address (plaintext): report its per-class preemptions")
    p.add_argument("--floor-profile", metavar="YAML",
                   help="also report the floor: the run replayed on ideal sim engines of this profile "
                        "(services/bench/floor.py; needs --tokenizer)")
    p.add_argument("--floor-engines", type=int, default=8, help="engines of the floor's fleet")
    p.add_argument("--floor-speed-factor", type=float,
                   help="the floor's sim speed factor (default: the profile's; bench_peers runs 4)")
    p.add_argument("--floor-total-blocks", type=int,
                   help="also the floor on the fleet's own KV: this many blocks per engine, pooled, "
                        "clairvoyant eviction (bench_peers runs 640)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--json", help="write results JSON here")
    p.add_argument("--chart", help="write a PNG chart here")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_bench)
    return p


def _headers(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        name, sep, value = item.partition(":")
        if not sep or not name.strip():
            raise SystemExit(f"kvmesh bench: --header {item!r}: use NAME:VALUE")
        out[name.strip()] = value.strip()
    return out


async def _main(ns: argparse.Namespace) -> int:
    import aiohttp

    from services.bench.chart import write_chart
    from services.bench.report import format_summary, write_json
    from services.bench.runner import Target, resolve_model

    mix = tuple(float(x) for x in ns.priority_mix.split(","))
    try:
        kind = WorkloadKind(ns.workload)
        spec = spec_for(
            kind, ns.requests, seed=ns.seed, groups=ns.groups, context_tokens=ns.context_tokens,
            context_spread=ns.context_spread, zipf=ns.zipf, question_words=ns.question_words,
            max_tokens=ns.max_tokens, turns=ns.turns, think_seconds=ns.think_seconds,
            long_fraction=ns.long_fraction, long_max_tokens=ns.long_max_tokens, priority_mix=mix,
        )
        rate = ns.rate if ns.rate is not None else CACHE_PRESSURE_RATE if kind is WorkloadKind.CACHE_PRESSURE else 8.0
        arrival = ArrivalSpec(Arrival(ns.arrival), rate, ns.gamma_shape, ns.concurrency)
    except ValueError as exc:
        print(f"kvmesh bench: {exc}", file=sys.stderr)
        return 2
    if ns.floor_profile and not ns.tokenizer:
        print("kvmesh bench: --floor-profile needs --tokenizer (the model dir: exact prompt tokens)", file=sys.stderr)
        return 2
    model = ns.model
    if not model:
        async with aiohttp.ClientSession() as s:
            model = await resolve_model(s, ns.url, ns.api_key)
    target = Target(ns.url, model, ns.api_key, ns.path, _headers(ns.header), ns.timeout,
                    priority_in_body=ns.priority_in_body)
    run, summary = await bench(spec, arrival, target, token_counter(ns.tokenizer), show_progress=not ns.quiet,
                               scheduler=ns.scheduler)
    print(format_summary(summary))
    if ns.floor_profile:
        summary["floor"] = _floor(ns, run, None)
        print(f"floor ({ns.floor_engines} x {Path(ns.floor_profile).stem}, unbounded KV):\n"
              + format_summary({"overall": summary["floor"], "classes": {}}))
    if ns.floor_profile and ns.floor_total_blocks:
        summary["floor_kv"] = _floor(ns, run, ns.floor_total_blocks)
        print(f"floor ({ns.floor_engines} x {ns.floor_total_blocks} KV blocks, pooled):\n"
              + format_summary({"overall": summary["floor_kv"], "classes": {}}))
    meta = {"url": ns.url, "model": model, "workload": ns.workload, "arrival": ns.arrival, "rate": arrival.rate,
            "concurrency": ns.concurrency, "seed": ns.seed, "requests": ns.requests}
    if ns.json:
        write_json(Path(ns.json), meta, summary, run.results)
    if ns.chart:
        title = f"{ns.workload} @ {ns.url} ({ns.arrival}, seed {ns.seed})"
        write_chart(Path(ns.chart), run.results, summary, title)
    return 0 if summary["overall"]["ok"] else 1


def _floor(ns: argparse.Namespace, run: RunResult, total_blocks: int | None) -> dict[str, Any]:
    """The run's floor (services/bench/floor.py) on --floor-engines engines of
    --floor-profile; with `total_blocks`, on their own KV (kv_bounded)."""
    from services.bench.floor import floor_summary
    from services.common.config import MeshConfig
    from services.engine.sim.profiles import apply_profile, load_profile

    config = MeshConfig()
    apply_profile(config, load_profile(ns.floor_profile), speed_factor=ns.floor_speed_factor)
    engine = config.engines.template
    if total_blocks:
        engine.total_blocks = total_blocks
    return floor_summary(run.results, engine, ns.floor_engines, Path(ns.tokenizer), kv_bounded=bool(total_blocks))


def _cmd_bench(ns: argparse.Namespace) -> None:
    try:
        import uvloop

        code = uvloop.run(_main(ns))
    except ImportError:  # pragma: no cover - uvloop is a dependency
        code = asyncio.run(_main(ns))
    sys.exit(code)
