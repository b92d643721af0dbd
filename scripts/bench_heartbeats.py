#!/usr/bin/env python3
"""What an engine's heartbeat costs the scheduler while a queue waits.

A busy fleet always has something queued (a batch backlog, a burst): every
engine sends an unchanged load report at least every stale_report_seconds / 4
(0.5 s), so at 1,024 engines the core handles ~2,000 heartbeats a second. In
process, no gRPC: a SchedulerCore (the default config: predicted_ttft) with
N engines, every lease slot taken, a queue of waiting requests; then each
engine's heartbeat (its last load again), R rounds, on a fake clock. Prints
the core's CPU per heartbeat and the placement decisions they caused.
`--changed`: each report differs from the last (a block more or less in
use, no room made), as reports do around every start and end of a
generation: each dispatches, and tries to place the queue's head on a fleet
with no free slot.

    .venv/bin/python scripts/bench_heartbeats.py --engines 64 256 1024
    .venv/bin/python scripts/bench_heartbeats.py --engines 64 256 1024 --changed
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.common.clock import FakeClock
from services.common.config import MeshConfig
from services.scheduler.core import SchedulerCore
from services.scheduler.engine_registry import EngineInfo, EngineLoad
from services.scheduler.events import EngineJoined, LoadReported, RequestArrived
from services.scheduler.records import AdmitOptions

MODEL = "m"
SLOTS = 4


def _full_fleet(engines: int, waiting: int) -> tuple[SchedulerCore, FakeClock, dict[str, int]]:
    config = MeshConfig()
    config.scheduler.metrics_port = 0
    config.scheduler.engine_queue_slack = 0
    clock = FakeClock()
    core = SchedulerCore(config, clock)
    tokens: dict[str, int] = {}
    for i in range(engines):
        engine_id = f"e{i}"
        tokens[engine_id] = core.handle(EngineJoined(EngineInfo(
            engine_id=engine_id, address=f"{engine_id}:1", model=MODEL, block_size=16, total_blocks=1000,
            max_running=SLOTS, weight=1.0, max_model_len=0))).token
        core.handle(LoadReported(engine_id, tokens[engine_id], EngineLoad(serving=True, blocks_total=1000)))
    hashes = tuple(range(1, 126))
    for n in range(engines * SLOTS + waiting):   # fill every slot, then queue the rest
        core.handle(RequestArrived(AdmitOptions(request_id=f"r{n}", model=MODEL, tenant="t", priority=2,
                                                prompt_tokens=2000, max_tokens=16, prefix_hashes=hashes)))
    return core, clock, tokens


def _run(engines: int, waiting: int, rounds: int, changed: bool) -> tuple[float, float]:
    core, clock, tokens = _full_fleet(engines, waiting)
    loads = {e: core.fleet.get(e).load for e in tokens}   # type: ignore[union-attr]  # every id is registered
    other = {e: dataclasses.replace(load, blocks_used=load.blocks_used + 1) for e, load in loads.items()}
    decisions = core.metrics.value("kvmesh_scheduler_decision_seconds_count", {"policy": core.policy.name})
    began = time.process_time()
    for n in range(rounds):
        clock.advance(0.5)
        sent = other if changed and n % 2 == 0 else loads
        for engine_id, token in tokens.items():
            core.handle(LoadReported(engine_id, token, sent[engine_id]))
    spent = time.process_time() - began
    made = core.metrics.value("kvmesh_scheduler_decision_seconds_count", {"policy": core.policy.name}) - decisions
    beats = rounds * engines
    return spent / beats * 1e6, made / beats


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engines", type=int, nargs="+", default=[64, 256, 1024])
    p.add_argument("--waiting", type=int, default=64, help="requests queued behind the full fleet")
    p.add_argument("--rounds", type=int, default=4, help="heartbeats per engine")
    p.add_argument("--changed", action="store_true", help="each report differs from the last (see above)")
    args = p.parse_args(argv)
    print("| engines | waiting | us CPU per heartbeat | placement decisions per heartbeat "
          "| cores at 2 per engine per s |")
    print("|---:|---:|---:|---:|---:|")
    for engines in args.engines:
        us, decisions = _run(engines, args.waiting, args.rounds, args.changed)
        print(f"| {engines} | {args.waiting} | {us:.1f} | {decisions:.2f} | {us * 2 * engines / 1e6:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
