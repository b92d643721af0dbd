"""Issue 18's batch benchmark: does a Batch API batch fill the fleet's idle
capacity while interactive (P0) latency stays where it was?
(BENCHMARKS.md, "Batch API on idle capacity").

Starts a mesh in-process -- scheduler, `--engines` sim engines calibrated as
Meta-Llama-3-8B on an A100 (config/sim-profiles/), slowed `--speed-factor`
times so two shared cores stay ahead of the simulated GPUs, a gateway and
Envoy on free loopback ports -- then, per run (`--runs`), all through Envoy:

 1. capacity: closed-loop P2 chat streams shaped exactly like the batch's
    lines (same prompts' length, same max_tokens), twice as many in flight as
    the mesh has lease slots: the fleet's output tokens/s flat out, counted
    over the part of the run where every slot was busy;
 2. P0 alone: open-loop Poisson P0 chat streams at `--p0-rate`/s for
    `--seconds` s (shared-context chats, `kvmesh bench`'s generator and
    client, contexts warmed first): TTFT p50/p90/p99 and the output tokens/s
    the P0 load itself takes;
 3. P0 with the batch: the official `openai` SDK uploads a JSONL file
    (`client.files.create`) and creates a batch (`client.batches.create`);
    once it runs (`--ramp-seconds` after its first line is done) the SAME P0
    load (fresh contexts, same arrival times and shapes) runs again, while
    `client.batches.retrieve` is polled every `--poll-seconds`; the batch is
    then waited for, its output file read back (every custom_id once).

Idle capacity = capacity (1) - the P0 load's own tokens/s (2): what the same
fleet could still produce beside the P0 load, measured in the same run with
the batch's request shape (a cost-model figure would miss the mesh's own
overhead and the machine's load). The batch's tokens/s during the P0 window
= lines completed in the window (interpolated between polls) x their mean
completion tokens / the window; it is reported against idle capacity
(target ~1), and P0 TTFT p99 with / without (target within 10%). The
batch's own rate after the P0 load stopped ("batch alone") shows what its
runner reaches with the fleet to itself. TTFT is wall time; the sim's
simulated time is wall / speed factor.

    .venv/bin/python scripts/bench_batch.py                     # 1 run, ~4 min on 2 cores
    .venv/bin/python scripts/bench_batch.py --runs 3 --json /tmp/bench_batch.json

Bounded: every phase ends by itself (requests time out, the batch wait has
`--batch-timeout`), the mesh is stopped on exit or failure, loopback only.
Not a test: it measures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import random
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench_priorities import lease_slots, mesh_config, sim_mesh, warm
from scenario_preemption import write_json

from services.bench.cli import token_counter
from services.bench.runner import Target, run_workload
from services.bench.scheduler_classes import scheduler_state
from services.bench.stats import RequestResult, percentiles
from services.bench.workloads import (
    Arrival,
    ArrivalSpec,
    Conversation,
    Turn,
    WorkloadKind,
    WorkloadSpec,
    build_workload,
)
from services.launcher.mesh import Mesh

MODEL = "tiny-llama"
_WORDS = ("river ledger invoice parcel harbor customs tariff warranty schedule appendix delivery payment "
          "notice supplier carrier auditor report summary table chapter market value order account").split()


# ---------------------------------------------------------------- the batch's lines

def batch_lines(n: int, words: int, max_tokens: int, salt: str, seed: int) -> list[dict[str, Any]]:
    """`n` Batch API input lines: unique chat prompts of ~`words` tokens,
    exactly `max_tokens` answer tokens each (ignore_eos, as `kvmesh bench`)."""
    rng = random.Random(seed)
    return [{
        "custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions",
        "body": {"model": MODEL, "max_tokens": max_tokens, "ignore_eos": True, "messages": [
            {"role": "user", "content": f"{salt}Summarise item {i}: " + " ".join(rng.choices(_WORDS, k=words))}]},
    } for i in range(n)]


def as_conversations(lines: list[dict[str, Any]]) -> list[Conversation]:
    """The same requests as P2 chat streams (the capacity phase)."""
    return [Conversation(i, 0.0, "", (Turn(line["body"]["messages"][0]["content"], line["body"]["max_tokens"]),),
                         2, 0) for i, line in enumerate(lines)]


# ---------------------------------------------------------------- phases

def saturated_tokens_per_s(results: list[RequestResult]) -> float:
    """Output tokens/s while every worker was busy: from the first send to
    the last send (after it workers run dry), each stream's tokens spread
    evenly over its generation and counted inside that window."""
    ok = [r for r in results if r.ok and r.e2e is not None]
    start, end = min(r.start for r in ok), max(r.start for r in ok)
    if end - start < 1.0:
        raise RuntimeError("capacity phase too short: raise --capacity-requests")
    tokens = 0.0
    for r in ok:
        first, last = r.start + (r.ttft or 0.0), r.start + (r.e2e or 0.0)
        inside = max(0.0, min(last, end) - max(first, start))
        tokens += r.completion_tokens * (inside / (last - first) if last > first else float(start <= last <= end))
    return tokens / (end - start)


def capacity(args: argparse.Namespace, target: Target, mesh: Mesh, run: int) -> float:
    lines = batch_lines(args.capacity_requests, args.line_words, args.line_max_tokens, f"[cap {run}] ", run)
    closed = ArrivalSpec(Arrival.CLOSED, concurrency=2 * lease_slots(mesh.config))
    result = asyncio.run(run_workload(as_conversations(lines), closed, target))
    failed = [r.error for r in result.results if not r.ok]
    if failed:
        raise RuntimeError(f"capacity phase: {len(failed)} failed, e.g. {failed[:2]}")
    return saturated_tokens_per_s(result.results)


def p0_load(args: argparse.Namespace, target: Target, salt: str, count: Any) -> dict[str, Any]:
    """The P0 load (contexts warmed first): TTFT percentiles and its tokens/s."""
    n = max(1, math.ceil(args.p0_rate * args.seconds))
    spec = WorkloadSpec(WorkloadKind.MIXED_PRIORITY, conversations=n, seed=args.seed, groups=args.groups,
                        context_tokens=args.context_tokens, max_tokens=args.p0_max_tokens,
                        priority_mix=(1.0, 0.0, 0.0), salt=salt)
    arrival = ArrivalSpec(Arrival.POISSON, rate=args.p0_rate)
    warm(spec, arrival, target, count)
    started = time.monotonic()
    result = asyncio.run(run_workload(build_workload(spec, arrival, count), arrival, target))
    ok = [r for r in result.results if r.ok]
    ttft = percentiles([r.ttft for r in ok if r.ttft is not None])
    # Placed away from its cached context (less than half the prompt cached): a cold prefill.
    cold = [r for r in ok if r.cached_tokens * 2 < r.prompt_tokens]
    return {"window": (started, time.monotonic()), "sent": n, "ok": len(ok), "cold": len(cold),
            "cold_ttft_ms": percentiles([r.ttft * 1000 for r in cold if r.ttft is not None]),
            "errors": sorted({r.error[:80] for r in result.results if not r.ok}),
            "ttft_ms": {k: (None if v is None else v * 1000) for k, v in ttft.items()},
            "tokens_per_s": sum(r.completion_tokens for r in ok) / args.seconds}


@dataclass
class BatchPoll:
    """`client.batches.retrieve` every `every` s in a thread: (monotonic,
    status, completed, failed) samples."""

    client: Any
    batch_id: str
    every: float
    samples: list[tuple[float, str, int, int]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        while not self._stop.is_set():
            b = self.client.batches.retrieve(self.batch_id)
            counts = b.request_counts
            self.samples.append((time.monotonic(), b.status, counts.completed if counts else 0,
                                 counts.failed if counts else 0))
            if b.status in ("completed", "failed", "expired", "cancelled"):
                return
            self._stop.wait(self.every)

    def stop(self) -> None:
        self._stop.set()

    def completed_at(self, t: float) -> float:
        """Lines completed by monotonic time `t`, linear between samples."""
        before = [(s[0], s[2]) for s in self.samples if s[0] <= t]
        after = [(s[0], s[2]) for s in self.samples if s[0] > t]
        if not before:
            return 0.0
        if not after:
            return float(before[-1][1])
        (t0, c0), (t1, c1) = before[-1], after[0]
        return c0 + (c1 - c0) * (t - t0) / (t1 - t0)

    def first_done(self) -> float | None:
        return next((s[0] for s in self.samples if s[2] > 0), None)


def read_output(client: Any, batch: Any) -> dict[str, Any]:
    """The output file: lines, distinct custom_ids, completion tokens; the
    error file's line count."""
    ids, tokens, errors = [], 0, 0
    if batch.output_file_id:
        for raw in client.files.content(batch.output_file_id).text.splitlines():
            line = json.loads(raw)
            ids.append(line["custom_id"])
            body = (line.get("response") or {}).get("body") or {}
            tokens += int((body.get("usage") or {}).get("completion_tokens") or 0)
    if batch.error_file_id:
        errors = len(client.files.content(batch.error_file_id).text.splitlines())
    return {"lines": len(ids), "distinct": len(set(ids)), "tokens": tokens, "error_lines": errors}


def with_batch(args: argparse.Namespace, target: Target, mesh: Mesh, cap: float, run: int,
               count: Any) -> dict[str, Any]:
    """Phase 3: the batch, then the P0 load beside it; the batch waited for."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{mesh.endpoints.public_http}/v1", api_key=mesh.api_key, max_retries=5)
    runtime = args.ramp_seconds + args.seconds + args.alone_seconds + 10.0   # + the P0 contexts' warm-up
    n = args.lines or max(50, math.ceil(cap * runtime / args.line_max_tokens))
    data = "\n".join(json.dumps(line) for line in batch_lines(
        n, args.line_words, args.line_max_tokens, f"[batch {run}] ", 1000 + run)).encode()
    upload = client.files.create(file=("bench-batch.jsonl", data), purpose="batch")
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    poll = BatchPoll(client, batch.id, args.poll_seconds)
    poller = threading.Thread(target=poll.run, daemon=True)
    poller.start()
    try:
        deadline = time.monotonic() + 120.0
        while poll.first_done() is None and poller.is_alive() and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(args.ramp_seconds)
        before = scheduler_state(mesh.endpoints.scheduler)
        p0 = p0_load(args, target, f"[p0+batch {run}] ", count)
        after = scheduler_state(mesh.endpoints.scheduler)
        poller.join(args.batch_timeout)
    finally:
        poll.stop()
    final = client.batches.retrieve(batch.id)
    t0, t1 = p0["window"]
    done_in_window = poll.completed_at(t1) - poll.completed_at(t0)
    output = read_output(client, final)
    per_line = output["tokens"] / output["lines"] if output["lines"] else float(args.line_max_tokens)
    last = poll.samples[-1][0] if poll.samples else t1
    alone_from = t1 + 2.0   # the P0 streams still running at t1 end within ~2 s
    alone_done = poll.completed_at(last) - poll.completed_at(alone_from)
    return {
        "lines": n, "status": final.status, "output": output, "p0": p0,
        "tokens_per_s_in_window": done_in_window * per_line / (t1 - t0),
        "tokens_per_s_alone": alone_done * per_line / (last - alone_from) if last - alone_from > 5 else None,
        "tokens_per_s_whole": (output["tokens"] / (final.completed_at - final.in_progress_at)
                               if final.completed_at and final.in_progress_at else None),
        "preemptions": _preemptions(before, after),
    }


def _preemptions(before: Any, after: Any) -> dict[str, float]:
    """Batch lines' and all P2 preemptions during the P0 window (GetState)."""
    def read(state: Any) -> tuple[float, float]:
        p2 = [c for c in getattr(state, "classes", ()) if c.priority == 2]
        return (float(p2[0].preemptions), float(getattr(p2[0], "batch_preemptions", 0))) if p2 else (0.0, 0.0)
    (a, b), (c, d) = read(before), read(after)
    return {"p2": c - a, "batch": d - b}


# ---------------------------------------------------------------- report

def one_run(args: argparse.Namespace, target: Target, mesh: Mesh, run: int, count: Any) -> dict[str, Any]:
    started = time.monotonic()
    cap = capacity(args, target, mesh, run)
    print(f"run {run}: capacity {cap:.0f} tok/s", file=sys.stderr, flush=True)
    alone = p0_load(args, target, f"[p0 {run}] ", count)
    print(f"run {run}: P0 alone TTFT {alone['ttft_ms']}", file=sys.stderr, flush=True)
    both = with_batch(args, target, mesh, cap, run, count)
    idle = cap - alone["tokens_per_s"]
    out = {"run": run, "capacity_tokens_per_s": cap, "p0_alone": alone, "with_batch": both,
           "idle_tokens_per_s": idle, "fill_ratio": both["tokens_per_s_in_window"] / idle if idle > 0 else None,
           "p99_ratio": _ratio(both["p0"]["ttft_ms"]["p99"], alone["ttft_ms"]["p99"]),
           "seconds": time.monotonic() - started}
    print(f"run {run}: {json.dumps(row_of(out))}", file=sys.stderr, flush=True)
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def _f(v: float | None, fmt: str = "{:.0f}") -> str:
    return "-" if v is None else fmt.format(v)


def row_of(r: dict[str, Any]) -> list[str]:
    a, b = r["p0_alone"]["ttft_ms"], r["with_batch"]["p0"]["ttft_ms"]
    w, o = r["with_batch"], r["with_batch"]["output"]
    return [str(r["run"]), " / ".join(_f(a[p]) for p in ("p50", "p90", "p99")),
            " / ".join(_f(b[p]) for p in ("p50", "p90", "p99")), _f(r["p99_ratio"], "{:.2f}"),
            f"{r['with_batch']['p0']['ok']} / {r['with_batch']['p0']['sent']}",
            f"{r['p0_alone']['cold']} / {r['with_batch']['p0']['cold']}",
            _f(w["tokens_per_s_in_window"]), _f(r["capacity_tokens_per_s"]),
            _f(r["p0_alone"]["tokens_per_s"]), _f(r["idle_tokens_per_s"]), _f(r["fill_ratio"], "{:.2f}"),
            _f(w["tokens_per_s_alone"]),
            f"{w['status']}: {o['lines']} ({o['distinct']} distinct) / {w['lines']}, {o['error_lines']} err",
            f"{w['preemptions']['batch']:.0f}"]


def table(runs: list[dict[str, Any]]) -> str:
    head = ["run", "P0 TTFT p50 / p90 / p99 ms alone", "with batch", "p99 with / alone", "P0 ok / sent",
            "P0 cold alone / with",
            "batch tok/s (P0 window)", "capacity tok/s", "P0 tok/s", "idle tok/s", "batch / idle",
            "batch alone tok/s", "batch lines out", "batch preemptions"]
    rows = [head, ["---"] * len(head), *(row_of(r) for r in runs)]
    return "\n".join("| " + " | ".join(r) + " |" for r in rows)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=1, help="measurements on the one mesh")
    p.add_argument("--engines", type=int, default=2)
    p.add_argument("--profile", default=str(ROOT / "config" / "sim-profiles" / "llama3-8b-a100.yaml"))
    p.add_argument("--speed-factor", type=float, default=4.0)
    p.add_argument("--total-blocks", type=int, default=2048, help="KV blocks per engine (0 = the profile's)")
    p.add_argument("--max-running", type=int, default=8, help="batch slots per engine (0 = the profile's)")
    p.add_argument("--p0-rate", type=float, default=2.0, help="P0 chats per second (open loop)")
    p.add_argument("--seconds", type=float, default=40.0, help="seconds of P0 arrivals per phase")
    p.add_argument("--groups", type=int, default=4, help="P0 shared contexts")
    p.add_argument("--context-tokens", type=int, default=1000)
    p.add_argument("--p0-max-tokens", type=int, default=32)
    p.add_argument("--line-words", type=int, default=200, help="prompt length of a batch line (~tokens)")
    p.add_argument("--line-max-tokens", type=int, default=128)
    p.add_argument("--lines", type=int, default=0, help="batch lines (0 = enough to outlast the P0 phase)")
    p.add_argument("--capacity-requests", type=int, default=160)
    p.add_argument("--ramp-seconds", type=float, default=5.0, help="batch running this long before the P0 load")
    p.add_argument("--alone-seconds", type=float, default=15.0, help="batch left to run alone after the P0 load")
    p.add_argument("--poll-seconds", type=float, default=0.5)
    p.add_argument("--batch-timeout", type=float, default=900.0)
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--set", action="append", metavar="SECTION.FIELD=VALUE", help="config override (repeat)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", help="write every figure here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    logging.basicConfig(level=logging.WARNING)
    count = token_counter(str(ROOT / ".models" / MODEL))
    runs: list[dict[str, Any]] = []
    with sim_mesh(mesh_config(args), args.engines, "kvmesh-bench-batch-") as mesh:
        target = Target(mesh.endpoints.public_http, MODEL, mesh.api_key, timeout_seconds=args.request_timeout)
        for run in range(1, args.runs + 1):
            runs.append(one_run(args, target, mesh, run, count))
    print(f"\n{args.engines} sim engines ({Path(args.profile).stem}, speed {args.speed_factor:g}, max_running "
          f"{args.max_running}, {args.total_blocks} blocks); P0: Poisson {args.p0_rate:g}/s for {args.seconds:g} s, "
          f"{args.groups} contexts x {args.context_tokens} tokens, max_tokens {args.p0_max_tokens}; batch lines: "
          f"~{args.line_words}-token prompts, max_tokens {args.line_max_tokens}; TTFT wall ms "
          f"(simulated = wall / {args.speed_factor:g})")
    print(table(runs))
    write_json(args.json, {"args": vars(args), "runs": runs})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
