"""Soak: an hour of mixed traffic on a sim mesh with a fault every minute or
two. Prints what clients saw and how each long-lived process's memory and
open files moved; exits 1 on any lost request or a slope over its bound.

    nice -n 10 .venv/bin/python scripts/soak.py --minutes 60 --seed 1
    .venv/bin/python scripts/soak.py --minutes 4 --fault-min 20 --fault-max 40   # a quick look

Not part of `make test` (an hour). The mesh is the chaos run's loopback one
(scripts/chaoslib/loopback.py: scheduler, 2 sim engines, the batch service,
2 gateways, Envoy on free ports, restarted as `kvmesh up` restarts them)
with its response cache and Responses store on a real redis-server
(scripts/soaklib/redis_store.py). Its results: RELIABILITY.md "Soak".

Traffic, all the time (scripts/soaklib/traffic.py; the streamed kinds are
the chaos clients, resuming a cut stream with Last-Event-ID): streamed
completions in P0, P1 and P2; streamed chat in P0 and P2; streamed
structured outputs (json_schema); non-streamed chat, forced tool calls and
structured outputs; repeated questions under a key with the response cache
on (hits); two Responses conversations of six turns chained with
`previous_response_id`; and one Batch API batch after another
(soaklib/batches.py). Every answer is checked against the uninterrupted
answer to the same request taken before the first fault; each request ends
completed, rejected (a definite answer: an OpenAI error body) or lost.

Faults (soaklib/faults.py): one every --fault-min..--fault-max seconds
(seeded), SIGKILL of an engine, the scheduler, a gateway, the batch
service; an engine SIGSTOPped for --hang-seconds; a rolling restart of the
gateways -- planned so that each kind of service keeps one long life to
measure. No partitions (the loopback mesh has no links to cut).

Resources (soaklib/series.py): VmRSS and open fds of every service process
and of Redis every --sample-seconds, one series per process; after the
warm-up (from the run's start and from each process's own start), the
least-squares slope per hour against the bounds written there.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scripts.soaklib import run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=60.0, help="how long to run traffic and faults")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--warmup-minutes", type=float, default=None,
                        help="not fitted, from the run's start and each process's own (default min(10, minutes/4))")
    parser.add_argument("--min-span-minutes", type=float, default=None,
                        help="a series is judged when it spans this much after its warm-up (default: the warm-up)")
    parser.add_argument("--fault-min", type=float, default=60.0, help="seconds between faults, at least")
    parser.add_argument("--fault-max", type=float, default=120.0, help="seconds between faults, at most")
    parser.add_argument("--hang-seconds", type=float, default=20.0, help="how long `hang` keeps an engine stopped")
    parser.add_argument("--batch-lines", type=int, default=200, help="lines in each Batch API batch")
    parser.add_argument("--sample-seconds", type=float, default=10.0, help="how often RSS and fds are read")
    parser.add_argument("--speed-factor", type=float, default=0.5, help="sim cost model speed factor")
    parser.add_argument("--max-running", type=int, default=16, help="sim engine batch size")
    parser.add_argument("--run-dir", default="", help="mesh and Redis run directory (default: a new temp dir)")
    parser.add_argument("--out", default="", help="the JSON result (default: <run dir>/soak-result.json)")
    ns = parser.parse_args()
    if not 0 < ns.minutes <= 180:
        parser.error("--minutes must be in (0, 180]")
    if not 0 < ns.fault_min <= ns.fault_max:
        parser.error("--fault-min must be > 0 and <= --fault-max")
    if ns.warmup_minutes is None:
        ns.warmup_minutes = min(10.0, ns.minutes / 4)
    if ns.min_span_minutes is None:
        ns.min_span_minutes = ns.warmup_minutes
    try:
        sys.exit(asyncio.run(run.run(ns)))
    except (KeyboardInterrupt, asyncio.CancelledError):
        print("soak: interrupted (Ctrl-C or SIGTERM); the mesh and Redis are torn down", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    main()
