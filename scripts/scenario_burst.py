"""Issue 13's burst: one tenant sends `--requests` (3,000) requests at once,
a third each P0 / P1 / P2, and the tenant's queue cap is what binds.

Starts a mesh in-process (scheduler, `--engines` sim engines, a gateway and
Envoy on free loopback ports, the default config unless `--set` overrides
it), sends every request at once through Envoy's OpenAI endpoint with the
mesh's one API key (tenant "dev"), classes interleaved in a seeded shuffle,
short answers (`--max-tokens`), and counts per class: completed, 429
`tenant_full`, 429 other (e.g. `queue_full`), other statuses, errors, and how
long each rejection took (send -> response) and whether it carried
Retry-After. A rejection is decided when the request reaches the scheduler,
but in a burst that moment includes the gateway's intake of the requests
ahead of it (each is tokenized first): the 429s arrive together, as the
last requests are admitted, so compare their times with the completed
requests' first tokens, which the table shows too. Default config: tenant_queue_cap 2000 and 2 x (64 + 2) lease
slots, so ~870 of 3,000 cannot queue (the issue saw 287 / 292 / 289).

The check the issue asks for: no P0 is refused while a lower-class request
of the same tenant is queued. It is decided from the scheduler's GetState,
polled every `--poll` s during the burst (queued requests per class and
tenant): a P0 429 counts when the last snapshot before its response and the
first one after it both show the tenant's P1 or P2 queue non-empty. Must be
0 after issue 13; today it is about the number of P0 429s.

    .venv/bin/python scripts/scenario_burst.py                    # ~1 min
    .venv/bin/python scripts/scenario_burst.py --requests 300 --set scheduler.tenant_queue_cap=150

Bounded (each request times out, the poller stops with the burst), the mesh
is stopped on exit or failure, loopback only. Exit status 1 when the check
fails. Not a test: it measures.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import contextlib
import logging
import random
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import grpc

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scenario_preemption import add_mesh_args, on_mesh, write_json

from services.bench.scheduler_classes import class_figures
from services.bench.stats import percentile
from services.bench.timed_stream import ChatCall, TimedStream, chat_stream
from services.common.proto.kvmesh.v1 import scheduler_pb2, scheduler_pb2_grpc
from services.launcher.mesh import Mesh

TENANT = "dev"  # the tenant of the key the launcher generates


def outcome(s: TimedStream) -> str:
    if s.ok:
        return "completed"
    if s.status == 429:
        return "429 tenant_full" if "tenant_full" in (s.error_code + s.error) else "429 other"
    if s.status:
        return f"HTTP {s.status}" if s.status != 200 else "stream error"
    return "no answer"


# ---------------------------------------------------------------- GetState poller


class Poller:
    """GetState every `interval` s in a thread: (time, queued per class for TENANT)."""

    def __init__(self, address: str, interval: float) -> None:
        self.address = address
        self.interval = interval
        self.times: list[float] = []
        self.queued: list[tuple[int, int, int]] = []
        self.last_state: scheduler_pb2.SchedulerState | None = None
        self._stop = asyncio.Event()

    def _sample(self, stub: scheduler_pb2_grpc.SchedulerStub) -> None:
        try:
            state = stub.GetState(scheduler_pb2.GetStateRequest(), timeout=5)
        except grpc.RpcError:
            return
        now = time.monotonic()
        counts = [0, 0, 0]
        for q in state.queues:
            if q.tenant == TENANT and 0 <= q.priority < 3:
                counts[q.priority] += q.queued
        self.times.append(now)
        self.queued.append((counts[0], counts[1], counts[2]))
        self.last_state = state

    async def run(self) -> None:
        with grpc.insecure_channel(self.address) as channel:
            stub = scheduler_pb2_grpc.SchedulerStub(channel)
            while not self._stop.is_set():
                await asyncio.to_thread(self._sample, stub)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), self.interval)

    def stop(self) -> None:
        self._stop.set()

    def lower_queued_around(self, t: float) -> bool | None:
        """P1 or P2 of TENANT queued in the snapshots on both sides of t;
        None when there is no snapshot on one side."""
        k = bisect.bisect_right(self.times, t)
        if k == 0 or k == len(self.times):
            return None
        before, after = self.queued[k - 1], self.queued[k]
        return before[1] + before[2] > 0 and after[1] + after[2] > 0


# ---------------------------------------------------------------- the burst


async def burst(mesh: Mesh, args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    priorities = [i % 3 for i in range(args.requests)]
    rng.shuffle(priorities)
    calls = [ChatCall(mesh.endpoints.public_http, mesh.api_key, args.model,
                      f"Burst request {i} (P{p}): name three rivers.", args.max_tokens, p, args.request_timeout)
             for i, p in enumerate(priorities)]
    poller = Poller(mesh.endpoints.scheduler, args.poll)
    poll_task = asyncio.create_task(poller.run())
    await asyncio.sleep(args.poll * 2)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
        t0 = time.monotonic()
        try:
            streams = await asyncio.gather(*(chat_stream(session, c) for c in calls))
        finally:
            poller.stop()
            await poll_task
        makespan = time.monotonic() - t0
    return summarize(args, list(streams), poller, makespan)


def _ms(values: list[float], p: float) -> float | None:
    return round(percentile(values, p) * 1000, 1) if values else None


def summarize(args: argparse.Namespace, streams: list[TimedStream], poller: Poller,
              makespan: float) -> dict[str, Any]:
    per_class: dict[str, Any] = {}
    violations = unknown = 0
    for p in range(3):
        mine = [s for s in streams if s.call.priority == p]
        counts = Counter(outcome(s) for s in mine)
        rejected = [s for s in mine if s.status == 429]
        waits = [s.answered - s.sent for s in rejected if s.answered is not None]
        completed = [s.ended - s.sent for s in mine if s.ok and s.ended is not None]
        ttfts = [s.ttft for s in mine if s.ok and s.ttft is not None]
        per_class[f"P{p}"] = {
            "sent": len(mine), **dict(sorted(counts.items())),
            "reject_ms_p50": _ms(waits, 50), "reject_ms_p99": _ms(waits, 99),
            "reject_ms_max": round(max(waits) * 1000, 1) if waits else None,
            "rejects_without_retry_after": sum(s.retry_after is None for s in rejected),
            "completed_e2e_ms_p50": _ms(completed, 50),
            "completed_ttft_ms_min_p50": [_ms(ttfts, 0), _ms(ttfts, 50)],
            # What a failed stream said (a few, for the report): a preemption
            # must never turn into one of these.
            "failure_examples": [f"{s.status} {s.finish_reason} {s.error}"[:200]
                                 for s in mine if not s.ok and s.status != 429][:5],
        }
        if p == 0:
            for s in rejected:
                verdict = poller.lower_queued_around(s.answered or s.ended or s.sent)
                violations += verdict is True
                unknown += verdict is None
    return {
        "args": vars(args), "makespan_s": round(makespan, 2), "classes": per_class,
        "p0_refused_while_lower_queued": violations, "p0_refusals_without_snapshot": unknown,
        "snapshots": len(poller.times),
        "max_queued_per_class": [max((q[p] for q in poller.queued), default=0) for p in range(3)],
        "scheduler_classes": class_figures(poller.last_state),
    }


def report(doc: dict[str, Any]) -> bool:
    a = doc["args"]
    print(f"\n{a['requests']} requests at once from one tenant (a third each P0/P1/P2, max_tokens "
          f"{a['max_tokens']}), {a['engines']} sim engines; all answered in {doc['makespan_s']} s")
    keys = ["completed", "429 tenant_full", "429 other"]
    others = sorted({k for c in doc["classes"].values() for k in c
                     if k.startswith(("HTTP", "stream", "no answer"))})
    head = ["class", "sent", *keys, *others, "reject ms p50 / p99 / max", "429 without Retry-After",
            "completed TTFT ms min / p50"]
    rows = [head, ["---"] * len(head)]
    for name, c in doc["classes"].items():
        rows.append([name, str(c["sent"]), *(str(c.get(k, 0)) for k in keys + others),
                     f"{c['reject_ms_p50']} / {c['reject_ms_p99']} / {c['reject_ms_max']}",
                     str(c["rejects_without_retry_after"]),
                     " / ".join(str(v) for v in c["completed_ttft_ms_min_p50"])])
    print("\n".join("| " + " | ".join(r) + " |" for r in rows))
    for name, c in doc["classes"].items():
        for example in c.get("failure_examples", ()):
            print(f"{name} failed: {example}")
    print(f"most queued at once (GetState, {doc['snapshots']} snapshots): P0 / P1 / P2 = "
          + " / ".join(str(n) for n in doc["max_queued_per_class"]))
    if doc["scheduler_classes"]:
        for p, c in sorted(doc["scheduler_classes"].items()):
            print(f"scheduler class P{p}: " + ", ".join(f"{k} {v:g}" for k, v in c.items()))
    violations = doc["p0_refused_while_lower_queued"]
    print(f"P0 refused while a lower-class request of that tenant was queued: {violations}"
          + (f" ({doc['p0_refusals_without_snapshot']} P0 refusals had no snapshot on one side)"
             if doc["p0_refusals_without_snapshot"] else ""))
    held = violations == 0
    print(f"check: {'PASS' if held else 'FAIL'}  no P0 429 while a lower class of its tenant is queued")
    return held


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engines", type=int, default=2)
    p.add_argument("--requests", type=int, default=3000)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--poll", type=float, default=0.02, help="seconds between GetState snapshots")
    p.add_argument("--request-timeout", type=float, default=600.0)
    add_mesh_args(p)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    doc = on_mesh(args, "kvmesh-burst-", burst)
    held = report(doc)
    write_json(args.json, doc)
    return 0 if held else 1


if __name__ == "__main__":
    raise SystemExit(main())
