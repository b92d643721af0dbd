"""Issue 13's scenario: interactive (P0) requests under a flood of batch (P2)
streams that holds every slot of the mesh.

Starts a mesh in-process -- scheduler, `--engines` sim engines, a gateway and
Envoy on free loopback ports, the default config (config/kvmesh.yaml, as
`kvmesh up --backend sim --engines 2` runs it) -- then, all through Envoy's
OpenAI endpoint as a user would:

 1. idle: the 30 P0 requests (X-Priority: 0, `--p0-tokens` short answers)
    one after another, 0.2 s apart: each one's TTFT on the idle mesh;
 2. flood: `--clients` clients each keep one P2 stream of `--p2-tokens`
    tokens running without pause (closed loop; their starts spread over
    `--ramp` s so completions do not come in waves); waits until every
    engine's lease slots are taken and requests queue in the scheduler, then
    `--window` s more (the "before" throughput window);
 3. the same P0 requests again, one after another, 0.2 s apart: TTFT of each,
    in order, p50 / p99, and the ratio to the idle TTFT of the same request;
 4. `--window` s more of flood (the "after" window), then the clients stop
    starting streams and the running ones finish;
 5. text check: each P2 stream that was in flight during the P0 phase (the
    only ones a preemption can have touched; `--reference all` checks every
    one) is sent again alone on the now idle mesh: the sim's text is a pure
    function of the prompt and the tokens so far (services/engine/sim/text.py,
    greedy), so an uninterrupted run gives the reference; mismatches must be 0.

Prints the P2 throughput (tokens/s) before / during / after the P0 phase, P2
streams completed / errored, P2 TTFT of streams sent during the P0 phase,
and the scheduler's GetState `classes` (preemptions, requeued, time lost...)
when the scheduler fills them. Ends with the issue's checks (P0 p99 < 500 ms,
within `--max-ratio` of idle, 0 mismatches, 0 lost, throughput recovers);
exit status 1 when one fails. `--json FILE` writes everything.

    .venv/bin/python scripts/scenario_preemption.py                        # ~2 min
    .venv/bin/python scripts/scenario_preemption.py --clients 30 --p0 5 --p2-tokens 150 \
        --window 3 --set engines.template.max_running=8                   # ~30 s
    .venv/bin/python scripts/scenario_preemption.py --set scheduler.p0_reserved_leases=0

With the default config a P0 finds the lease slot each engine keeps for P0
(`scheduler.p0_reserved_leases: 1`), so the engine's side of issue 13 (a P0
joins the running batch at once) is what acts; with no lease kept, every P0
finds all slots taken and the scheduler must preempt a P2 lease.

Bounded: every loop ends by itself (a request times out after
`--request-timeout` s, the flood after its phases), the mesh is stopped on
exit or failure, everything listens on loopback. Not a test: it measures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.bench.scheduler_classes import class_deltas, class_figures
from services.bench.scheduler_classes import scheduler_state as get_scheduler_state
from services.bench.stats import percentile
from services.bench.timed_stream import ChatCall, TimedStream, chat_stream, tokens_between
from services.common.config import MeshConfig, load_config
from services.common.proto.kvmesh.v1 import scheduler_pb2
from services.launcher.mesh import Mesh, MeshOptions, start_on_free_ports

P0_GAP_SECONDS = 0.2


# ---------------------------------------------------------------- mesh


def mesh_config(args: argparse.Namespace) -> MeshConfig:
    config = load_config(Path(args.config))
    config.scheduler.metrics_port = 0
    config.gateway.metrics_port = 0
    for item in args.set or ():
        apply_override(config, item)
    return config


def apply_override(config: MeshConfig, item: str) -> None:
    """`--set scheduler.p0_reserved_leases=0`: one setting, YAML-typed value."""
    import yaml

    path, sep, raw = item.partition("=")
    if not sep:
        raise SystemExit(f"--set {item!r}: use SECTION.FIELD=VALUE")
    *parents, name = path.split(".")
    target: Any = config
    for part in parents:
        target = getattr(target, part)
    if not hasattr(target, name):
        raise SystemExit(f"--set {item!r}: no setting {path}")
    setattr(target, name, yaml.safe_load(raw))


def add_mesh_args(p: argparse.ArgumentParser) -> None:
    """The options the in-process-mesh scenarios (this one, scenario_burst.py)
    share, after their own: model, config and `--set` overrides, seed, `--json`
    and `--run-dir` (used by `mesh_config`, `on_mesh` and `write_json`)."""
    p.add_argument("--model", default="tiny-llama")
    p.add_argument("--config", default=str(ROOT / "config" / "kvmesh.yaml"))
    p.add_argument("--set", action="append", metavar="SECTION.FIELD=VALUE", help="config override (repeat)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", help="write the figures here")
    p.add_argument("--run-dir", help="keep the mesh's config and logs here (default: a temporary folder)")


def on_mesh(args: argparse.Namespace, prefix: str,
            body: Callable[[Mesh, argparse.Namespace], Coroutine[Any, Any, dict[str, Any]]]) -> dict[str, Any]:
    """Start `args.engines` sim engines (config from `mesh_config`, files in
    `--run-dir` or a temporary folder), run `body` on them, stop the mesh."""
    with tempfile.TemporaryDirectory(prefix=prefix) as scratch:
        options = MeshOptions(engines=args.engines, backend="sim", model=args.model, free_ports=True,
                              run_dir=Path(args.run_dir or scratch))
        print(f"starting a mesh: {args.engines} sim engines ...", file=sys.stderr, flush=True)
        mesh = start_on_free_ports(mesh_config(args), options)
        try:
            return asyncio.run(body(mesh, args))
        finally:
            mesh.stop_all()


def write_json(path: str | None, doc: dict[str, Any]) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(doc, indent=1, default=str))


def scheduler_state(mesh: Mesh) -> scheduler_pb2.SchedulerState | None:
    state: scheduler_pb2.SchedulerState | None = get_scheduler_state(mesh.endpoints.scheduler)
    return state


def lease_slots(mesh: Mesh) -> int:
    """Leases P2 requests can hold at most: per engine max_running +
    engine_queue_slack, less the ones kept for P0 (p0_reserved_leases, at
    most all but one, as placement caps it)."""
    scheduler = mesh.config.scheduler
    slots = mesh.config.engines.template.max_running + scheduler.engine_queue_slack
    return mesh.config.engines.count * (slots - min(scheduler.p0_reserved_leases, slots - 1))


# ---------------------------------------------------------------- the run


@dataclass
class Flood:
    """The closed-loop P2 clients and everything they saw."""

    calls: list[ChatCall] = field(default_factory=list)   # each client's requests, in order sent
    streams: list[TimedStream] = field(default_factory=list)
    stop: asyncio.Event = field(default_factory=asyncio.Event)


def p0_call(mesh: Mesh, args: argparse.Namespace, i: int) -> ChatCall:
    return ChatCall(mesh.endpoints.public_http, mesh.api_key, args.model,
                    f"Quick question {i}: what is the capital of country number {i}?", args.p0_tokens, 0,
                    args.request_timeout)


def p2_call(mesh: Mesh, args: argparse.Namespace, client: int, n: int) -> ChatCall:
    return ChatCall(mesh.endpoints.public_http, mesh.api_key, args.model,
                    f"Batch job {client}.{n}: write the full quarterly report for ledger {client * 1000 + n}.",
                    args.p2_tokens, 2, args.request_timeout)


async def p0_sequence(session: aiohttp.ClientSession, mesh: Mesh, args: argparse.Namespace) -> list[TimedStream]:
    """The P0 requests one after another, P0_GAP_SECONDS between them."""
    out = []
    for i in range(args.p0):
        if i:
            await asyncio.sleep(P0_GAP_SECONDS)
        out.append(await chat_stream(session, p0_call(mesh, args, i)))
    return out


async def p2_client(session: aiohttp.ClientSession, mesh: Mesh, args: argparse.Namespace, client: int,
                    delay: float, flood: Flood) -> None:
    await asyncio.sleep(delay)
    n = 0
    while not flood.stop.is_set():
        call = p2_call(mesh, args, client, n)
        flood.calls.append(call)
        flood.streams.append(await chat_stream(session, call))
        n += 1


async def wait_full(mesh: Mesh, timeout: float) -> float:
    """Until every lease slot is taken and requests wait in the scheduler."""
    want = lease_slots(mesh)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = await asyncio.to_thread(scheduler_state, mesh)
        if state is not None and state.leases_total >= want and state.queued_total > 0:
            return time.monotonic()
        await asyncio.sleep(0.2)
    raise RuntimeError(f"the flood did not take all {want} lease slots within {timeout:.0f} s "
                       "(more --clients, or a longer --ramp-timeout)")


async def run(mesh: Mesh, args: argparse.Namespace) -> dict[str, Any]:
    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:
        print(f"idle mesh: {args.p0} P0 requests, {P0_GAP_SECONDS} s apart ...", file=sys.stderr, flush=True)
        idle = await p0_sequence(session, mesh, args)
        classes_before = class_figures(await asyncio.to_thread(scheduler_state, mesh))
        flood = Flood()
        rng = random.Random(args.seed)
        t_flood = time.monotonic()
        clients = [asyncio.create_task(p2_client(session, mesh, args, c, rng.uniform(0, args.ramp), flood))
                   for c in range(args.clients)]
        try:
            full_at = await wait_full(mesh, args.ramp + args.ramp_timeout)
            print(f"flood: every lease slot held {full_at - t_flood:.1f} s after the first P2; "
                  f"{args.window:g} s of steady flood ...", file=sys.stderr, flush=True)
            await asyncio.sleep(args.window)
            p0_start = time.monotonic()
            loaded = await p0_sequence(session, mesh, args)
            p0_end = time.monotonic()
            print(f"P0 phase: {p0_end - p0_start:.1f} s; {args.window:g} s more of flood ...",
                  file=sys.stderr, flush=True)
            await asyncio.sleep(args.window)
            after_end = time.monotonic()
            flood.stop.set()
            state = await asyncio.to_thread(scheduler_state, mesh)
            await asyncio.gather(*clients)
        finally:
            flood.stop.set()
            for task in clients:
                task.cancel()
            await asyncio.gather(*clients, return_exceptions=True)
        classes_after = class_figures(await asyncio.to_thread(scheduler_state, mesh))
        phases = {"before": (p0_start - args.window, p0_start), "during": (p0_start, p0_end),
                  "after": (p0_end, after_end)}
        print("text check: the P2 streams again, alone on the idle mesh ...", file=sys.stderr, flush=True)
        checked, mismatches = await text_check(session, flood, (p0_start, p0_end), args)
    return summarize(args, idle, loaded, flood, phases, checked, mismatches,
                     classes_before, classes_after, state)


async def text_check(session: aiohttp.ClientSession, flood: Flood, p0_phase: tuple[float, float],
                     args: argparse.Namespace) -> tuple[int, list[dict[str, Any]]]:
    """Re-run each P2 stream to check (completed ones; with --reference
    overlap, those in flight during the P0 phase) at most `--reference-concurrency`
    at a time, and compare texts."""
    if args.reference == "none":
        return 0, []
    start, end = p0_phase
    todo = [s for s in flood.streams if s.ok and (
        args.reference == "all" or (s.sent < end and (s.ended or 0) > start))]
    gate = asyncio.Semaphore(args.reference_concurrency)

    async def again(s: TimedStream) -> dict[str, Any] | None:
        async with gate:
            ref = await chat_stream(session, s.call)
        if not ref.ok:
            return {"user": s.call.user, "error": f"reference run failed: {ref.error or ref.finish_reason}"}
        if ref.text != s.text:
            at = next((k for k, (a, b) in enumerate(zip(s.text, ref.text)) if a != b),
                      min(len(s.text), len(ref.text)))
            return {"user": s.call.user, "first_difference_at_char": at,
                    "chars": len(s.text), "reference_chars": len(ref.text)}
        return None

    results = await asyncio.gather(*(again(s) for s in todo))
    return len(todo), [r for r in results if r is not None]


# ---------------------------------------------------------------- figures


def _ms(values: list[float], p: float) -> float | None:
    return percentile(values, p) * 1000 if values else None


def summarize(args: argparse.Namespace, idle: list[TimedStream], loaded: list[TimedStream], flood: Flood,
              phases: dict[str, tuple[float, float]], checked: int, mismatches: list[dict[str, Any]],
              classes_before: dict[int, dict[str, float]], classes_after: dict[int, dict[str, float]],
              state: scheduler_pb2.SchedulerState | None) -> dict[str, Any]:
    loaded_ms = [s.ttft * 1000 if s.ttft is not None else None for s in loaded]
    idle_ms = [s.ttft * 1000 if s.ttft is not None else None for s in idle]
    ok_loaded = [v / 1000 for v in loaded_ms if v is not None]
    ok_idle = [v / 1000 for v in idle_ms if v is not None]
    throughput = {name: sum(tokens_between(s, a, b) for s in flood.streams) / (b - a) if b > a else None
                  for name, (a, b) in phases.items()}
    during = phases["during"]
    p2_sent_during = [s.ttft for s in flood.streams
                      if during[0] <= s.sent < during[1] and s.ttft is not None]
    errors = Counter((s.error_code or s.error or f"finish={s.finish_reason} done={s.done}")[:120]
                     for s in flood.streams if not s.ok)
    short = sum(1 for s in flood.streams if s.ok and s.completion_tokens != s.call.max_tokens)
    classes = class_deltas(classes_before, classes_after)
    return {
        "args": vars(args),
        "p0_ttft_ms": loaded_ms,
        "p0_idle_ttft_ms": idle_ms,
        "p0_ttft_p50_ms": _ms(ok_loaded, 50), "p0_ttft_p99_ms": _ms(ok_loaded, 99),
        "p0_idle_p50_ms": _ms(ok_idle, 50), "p0_idle_p99_ms": _ms(ok_idle, 99),
        "p0_failed": sum(not s.ok for s in loaded) + sum(not s.ok for s in idle),
        "p2_tokens_per_s": throughput,
        "p2_streams": len(flood.streams),
        "p2_completed": sum(s.ok for s in flood.streams),
        "p2_errored": sum(not s.ok for s in flood.streams),
        "p2_errors": dict(errors.most_common(5)),
        "p2_short": short,
        "p2_ttft_sent_during_p0_ms": {"n": len(p2_sent_during), "p50": _ms(p2_sent_during, 50),
                                      "max": max(p2_sent_during) * 1000 if p2_sent_during else None},
        "text_checked": checked,
        "text_mismatches": len(mismatches),
        "mismatch_examples": mismatches[:5],
        "classes": classes,
        "scheduler_at_end_of_flood": None if state is None else {
            "queued_total": state.queued_total, "leases_total": state.leases_total},
    }


def _fmt(v: float | None, spec: str = ".0f") -> str:
    return "-" if v is None else format(v, spec)


def report(doc: dict[str, Any], max_ratio: float) -> bool:
    """Print the figures and the checks; True when every check holds."""
    a = doc["args"]
    print(f"\n{a['engines']} sim engines, {a['clients']} P2 clients x {a['p2_tokens']} tokens (closed loop), "
          f"{a['p0']} sequential P0 requests x {a['p0_tokens']} tokens, {P0_GAP_SECONDS} s apart")
    print("P0 TTFT ms, in order:      " + ", ".join(_fmt(v) for v in doc["p0_ttft_ms"]))
    print("same P0 on the idle mesh:  " + ", ".join(_fmt(v) for v in doc["p0_idle_ttft_ms"]))
    p50, p99, i50, i99 = (doc[k] for k in ("p0_ttft_p50_ms", "p0_ttft_p99_ms", "p0_idle_p50_ms", "p0_idle_p99_ms"))
    ratio = p99 / i99 if p99 is not None and i99 else None
    print(f"P0 TTFT p50 / p99: {_fmt(p50)} / {_fmt(p99)} ms under the flood; idle {_fmt(i50)} / {_fmt(i99)} ms; "
          f"p99 ratio {_fmt(ratio, '.1f')}x")
    tp = doc["p2_tokens_per_s"]
    print(f"P2 throughput tokens/s: before {_fmt(tp['before'])}, during {_fmt(tp['during'])}, "
          f"after {_fmt(tp['after'])}")
    sent = doc["p2_ttft_sent_during_p0_ms"]
    print(f"P2 streams: {doc['p2_streams']} sent, {doc['p2_completed']} completed, {doc['p2_errored']} errored, "
          f"{doc['p2_short']} short of max_tokens; P2 sent during the P0 phase: {sent['n']}, "
          f"TTFT p50 {_fmt(sent['p50'])} ms, max {_fmt(sent['max'])} ms")
    for error, n in doc["p2_errors"].items():
        print(f"  {n} x {error}")
    print(f"text check: {doc['text_checked']} P2 streams compared with an uninterrupted run, "
          f"{doc['text_mismatches']} mismatches")
    for m in doc["mismatch_examples"]:
        print(f"  {m}")
    if doc["classes"]:
        print("scheduler GetState classes (during the flood):")
        for name, c in doc["classes"].items():
            print(f"  {name}: " + ", ".join(f"{k} {v:g}" for k, v in c.items()))
    else:
        print("scheduler GetState classes: not filled by this scheduler")
    checks = {
        "P0 TTFT p99 < 500 ms": p99 is not None and p99 < 500,
        f"P0 p99 within {max_ratio:g}x of idle": ratio is not None and ratio <= max_ratio,
        "every P0 completed": doc["p0_failed"] == 0,
        "no P2 stream lost": doc["p2_errored"] == 0 and doc["p2_short"] == 0,
        "0 text mismatches": doc["text_mismatches"] == 0,
        # 80%: two 8-s windows of a closed loop on a shared 2-core machine
        # differ by ~10% with no P0 at all (the run before issue 13: 88%).
        "P2 throughput recovers (after >= 80% of before)": (
            tp["before"] is not None and tp["after"] is not None and tp["after"] >= 0.8 * tp["before"]),
    }
    for name, held in checks.items():
        print(f"check: {'PASS' if held else 'FAIL'}  {name}")
    return all(checks.values())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engines", type=int, default=2)
    p.add_argument("--clients", type=int, default=250, help="closed-loop P2 clients")
    p.add_argument("--p2-tokens", type=int, default=400, help="tokens of each P2 stream")
    p.add_argument("--p0", type=int, default=30, help="sequential P0 requests")
    p.add_argument("--p0-tokens", type=int, default=16, help="tokens of each P0 answer")
    p.add_argument("--ramp", type=float, default=5.0, help="seconds the P2 clients' starts are spread over")
    p.add_argument("--ramp-timeout", type=float, default=120.0, help="most seconds to wait for full slots")
    p.add_argument("--window", type=float, default=8.0, help="seconds of flood before and after the P0 phase")
    p.add_argument("--reference", choices=["overlap", "all", "none"], default="overlap",
                   help="which P2 streams the text check re-runs")
    p.add_argument("--reference-concurrency", type=int, default=64)
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--max-ratio", type=float, default=3.0, help="check: P0 p99 at most this times idle")
    add_mesh_args(p)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    doc = on_mesh(args, "kvmesh-preemption-", run)
    held = report(doc, args.max_ratio)
    write_json(args.json, doc)
    return 0 if held else 1


if __name__ == "__main__":
    raise SystemExit(main())
