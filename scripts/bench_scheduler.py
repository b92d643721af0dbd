"""Scheduler overhead: placement decision latency at 1,000 admissions/s with
32 engines, in-process (issue 8).

Drives one `SchedulerCore` exactly as services/scheduler/service.py does --
`admit()` then `dispatch()` for a new request, `done()` when it ends,
`engine_load()` for every load report, `tick()` every 100 ms -- on a fake
clock that advances with a seeded Poisson arrival process, and times every
call with perf_counter (wall) and thread_time (this thread's CPU: the cost
without the machine's other processes). "Decision latency" = admit + the dispatch that
places it (what a request waits for in the scheduler's event loop when the
queue is empty); also reported: done + dispatch, and the share of one core
all scheduler work takes at this rate (must stay well under 100%). "All CPU
ms / admission": the thread CPU of every core call -- decisions, ends, load
reports, ticks -- over the admissions; "per core /s" its inverse: what one
core carries with this fleet's reports, before any gRPC.

Workload: 64 shared contexts of 2,000 tokens (125 hash blocks) plus a unique
tail, 16-token answers; every engine reports its KV state (a snapshot of the
contexts it holds) and its load every 100 ms (32 x 10 = 320 reports/s);
requests hold their lease for an exponential 0.5 s (about 500 in flight).

    .venv/bin/python scripts/bench_scheduler.py                # every policy, ~1 min
    .venv/bin/python scripts/bench_scheduler.py --policies sticky_until_saturated --seconds 20
    .venv/bin/python scripts/bench_scheduler.py --policies predicted_ttft --engines 1024 --candidates 0
    .venv/bin/python scripts/bench_scheduler.py --policies predicted_ttft --spares 2   # with warm spares held
    .venv/bin/python scripts/bench_scheduler.py --policies predicted_ttft --engines 1024 --quality

--quality (placement quality, not cost: the core explains each placement, which costs CPU): the
share of placements on an engine holding the prefix (hit rate), their mean cached tokens, and the
predicted TTFT (placement/predicted.py) of each placement on the engine chosen, p50 / p99 / mean,
and the most leases any engine held at once.
"""

from __future__ import annotations

import argparse
import heapq
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.bench.stats import percentile
from services.common.clock import FakeClock
from services.common.config import MeshConfig
from services.common.prefix_hash import block_hashes
from services.scheduler.core import SchedulerCore
from services.scheduler.engine_registry import EngineInfo, EngineLoad
from services.scheduler.events import (
    EngineJoined,
    KvSnapshotReported,
    LoadReported,
    RequestArrived,
    RequestDone,
    Tick,
)
from services.scheduler.placement import PlacementRequest
from services.scheduler.placement.predicted import predicted_ttft
from services.scheduler.records import AdmitOptions, PlacedInfo

POLICIES = ["round_robin", "least_load", "prefix_approx", "kv_precise", "sticky_until_saturated"]
# Also measurable by name (--policies): the default policy and its plain variant.
CHOICES = [*POLICIES, "predicted_ttft", "predicted_ttft_plain"]
MODEL = "m"


def run(policy: str, args: argparse.Namespace) -> dict[str, float]:
    rng = random.Random(args.seed)
    config = MeshConfig()
    config.scheduler.policy = policy
    if args.candidates is not None:
        config.scheduler.placement_candidates = args.candidates
    config.scheduler.metrics_port = 0
    config.scheduler.spares.count = args.spares
    clock = FakeClock()
    core = SchedulerCore(config, clock)
    core.explain = args.quality
    quality = _Quality(config.scheduler.prefill_tokens_per_second)
    contexts = [block_hashes([g * 7919 + i for i in range(args.context_tokens)], 16) for g in range(64)]
    tokens: dict[str, int] = {}
    for e in range(args.engines):
        eid = f"engine-{e}"
        tokens[eid] = core.handle(EngineJoined(
            EngineInfo(eid, f"127.0.0.1:{50000 + e}", MODEL, 16, 4096, 64, 1.0, 8192))).token
        held = [h for g in range(e * 2, e * 2 + 2) for h in contexts[g % 64]]
        core.handle(KvSnapshotReported(eid, tokens[eid], 1, held))
    running: dict[str, set[str]] = {eid: set() for eid in tokens}
    placed_on: dict[str, str] = {}
    requests: dict[str, PlacementRequest] = {}     # --quality: each request until placed

    def report(eid: str) -> None:
        ids = running[eid]
        load = EngineLoad(running=len(ids), waiting=0, blocks_used=min(4096, 140 * len(ids)), blocks_total=4096,
                          cached_blocks=250, serving=True, queued_tokens=0, request_ids=frozenset(ids))
        core.handle(LoadReported(eid, tokens[eid], load))

    for eid in tokens:
        report(eid)

    def absorb(deliveries: list) -> None:
        for rid, notice in deliveries:
            engine = getattr(notice, "engine_id", None)
            if engine:
                placed_on[rid] = engine
                running[engine].add(rid)
                request = requests.pop(rid, None)
                if request is not None and isinstance(notice, PlacedInfo):
                    quality.placed(request, notice, len(running[engine]))

    events: list[tuple[float, int, str, str]] = []  # (time, seq, kind, arg)
    seq = 0

    def push(at: float, kind: str, arg: str) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(events, (at, seq, kind, arg))

    t, n = 0.0, int(args.rate * args.seconds)
    for i in range(n):
        t += rng.expovariate(args.rate)
        push(t, "arrive", str(i))
    for k in range(int(args.seconds * 10) + 1):
        push(k * 0.1, "tick", "")
        for j, eid in enumerate(tokens):  # staggered reports
            push(k * 0.1 + j * 0.1 / args.engines, "report", eid)

    decision, decision_cpu, finish, other = [], [], [], 0.0
    report_cpu: list[float] = []
    all_cpu = 0.0   # thread CPU of every core call: decisions, ends, reports, ticks
    now = 0.0
    while events:
        at, _, kind, arg = heapq.heappop(events)
        clock.advance(max(0.0, at - now))
        now = max(now, at)
        if kind == "arrive":
            g = rng.randrange(64)
            prefix = tuple(contexts[g]) + tuple(rng.getrandbits(63) for _ in range(2))
            opts = AdmitOptions(f"r{arg}", MODEL, tenant=f"t{g % 8}", priority=rng.choice((0, 1, 1, 2)),
                                prompt_tokens=args.context_tokens + 32, max_tokens=16, prefix_hashes=prefix)
            if args.quality:
                requests[opts.request_id] = PlacementRequest(opts.request_id, MODEL, opts.prompt_tokens,
                                                             opts.max_tokens, prefix)
            t0, c0 = time.perf_counter(), time.thread_time()
            deliveries = core.handle(RequestArrived(opts)).notices  # admit + dispatch
            decision.append(time.perf_counter() - t0)
            decision_cpu.append(time.thread_time() - c0)
            all_cpu += decision_cpu[-1]
            absorb(deliveries)
            push(at + rng.expovariate(1 / args.hold_seconds), "done", f"r{arg}")
        elif kind == "done":
            engine = placed_on.pop(arg, None)
            if engine is None:  # still queued: try again a little later
                push(at + 0.05, "done", arg)
                continue
            running[engine].discard(arg)
            t0, c0 = time.perf_counter(), time.thread_time()
            deliveries = core.handle(RequestDone(arg)).notices
            finish.append(time.perf_counter() - t0)
            all_cpu += time.thread_time() - c0
            absorb(deliveries)
        elif kind == "report":
            t0, c0 = time.perf_counter(), time.thread_time()
            report(arg)
            other += time.perf_counter() - t0
            report_cpu.append(time.thread_time() - c0)
            all_cpu += report_cpu[-1]
        else:
            t0, c0 = time.perf_counter(), time.thread_time()
            absorb(core.handle(Tick()).notices)
            other += time.perf_counter() - t0
            all_cpu += time.thread_time() - c0
    busy = sum(decision) + sum(finish) + other
    ms = lambda xs, p: percentile(xs, p) * 1000  # noqa: E731
    return {"decisions": len(decision), "p50": ms(decision, 50), "p99": ms(decision, 99),
            "cpu_p50": ms(decision_cpu, 50), "cpu_p99": ms(decision_cpu, 99),
            "max": max(decision) * 1000, "done_p99": ms(finish, 99), "core_share": busy / args.seconds,
            "report_cpu_p50_us": ms(report_cpu, 50) * 1000, "all_cpu_per_admission": all_cpu * 1000 / len(decision),
            **quality.figures()}


class _Quality:
    """--quality: what the placements were like (hit rate, predicted TTFT, peak leases)."""

    def __init__(self, fallback: float) -> None:
        self.fallback = fallback
        self.cached: list[int] = []
        self.ttft: list[float] = []
        self.peak = 0

    def placed(self, request: PlacementRequest, notice: PlacedInfo, leases: int) -> None:
        self.cached.append(notice.cached_tokens)
        self.peak = max(self.peak, leases)
        scores = notice.detail.scores if notice.detail is not None else ()
        view = next((s.view for s in scores if s.view.engine_id == notice.engine_id), None)
        if view is not None:
            self.ttft.append(predicted_ttft(request, view, self.fallback))

    def figures(self) -> dict[str, float]:
        if not self.cached:
            return {}
        return {"hit_rate": sum(1 for c in self.cached if c > 0) / len(self.cached),
                "cached_mean": sum(self.cached) / len(self.cached), "peak_leases": self.peak,
                "ttft_p50": percentile(self.ttft, 50) * 1000, "ttft_p99": percentile(self.ttft, 99) * 1000,
                "ttft_mean": sum(self.ttft) * 1000 / max(1, len(self.ttft))}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--policies", nargs="+", default=POLICIES, choices=CHOICES)
    p.add_argument("--engines", type=int, default=32)
    p.add_argument("--rate", type=float, default=1000.0, help="admissions per second")
    p.add_argument("--seconds", type=float, default=10.0, help="simulated seconds per policy")
    p.add_argument("--context-tokens", type=int, default=2000)
    p.add_argument("--hold-seconds", type=float, default=0.5, help="mean lease duration")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--candidates", type=int, default=None,
                   help="scheduler.placement_candidates (0 = score every engine; default: the config's)")
    p.add_argument("--spares", type=int, default=0, help="scheduler.spares.count (warm spares held per model)")
    p.add_argument("--quality", action="store_true",
                   help="also print the placements' hit rate and predicted TTFT (explains placements: costs CPU)")
    args = p.parse_args(argv)
    print(f"{args.engines} engines, {args.rate:g} admissions/s for {args.seconds:g} s (fake clock), "
          f"prefix {args.context_tokens} tokens; decision = admit + dispatch, wall time per call"
          + ("" if args.candidates is None else f"; placement_candidates {args.candidates}"))
    print("| policy | decisions | p50 ms | p99 ms | max ms | CPU p50 / p99 ms | done+dispatch p99 ms "
          "| share of one core | report CPU p50 us | all CPU ms / admission | per core /s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for policy in args.policies:
        r = run(policy, args)
        print(f"| {policy} | {r['decisions']} | {r['p50']:.3f} | {r['p99']:.3f} | {r['max']:.1f} | "
              f"{r['cpu_p50']:.3f} / {r['cpu_p99']:.3f} | "
              f"{r['done_p99']:.3f} | {r['core_share']:.0%} | {r['report_cpu_p50_us']:.1f} | "
              f"{r['all_cpu_per_admission']:.3f} | {1000 / r['all_cpu_per_admission']:.0f} |", flush=True)
        if args.quality:
            print(f"  quality: hit rate {r['hit_rate']:.1%}, cached tokens mean {r['cached_mean']:.0f}, "
                  f"predicted TTFT p50 / p99 / mean {r['ttft_p50']:.1f} / {r['ttft_p99']:.1f} / "
                  f"{r['ttft_mean']:.1f} ms, peak leases on one engine {r['peak_leases']:.0f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
