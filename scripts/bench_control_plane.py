"""Control-plane capacity (issue 27): one or several real scheduler processes
over real gRPC on loopback, driven by synthetic gateways and synthetic
engines in other processes, at fleets of 64, 256 and 1,024 engines, with
offered admissions/s stepped up (open loop) until saturation.

    .venv/bin/python scripts/bench_control_plane.py                      # 64, 256, 1024 engines
    .venv/bin/python scripts/bench_control_plane.py --engines 64 --seconds 3 --max-rate 800
    .venv/bin/python scripts/bench_control_plane.py --schedulers 1 2 3   # each fleet with 1, 2, 3 replicas
    .venv/bin/python scripts/bench_control_plane.py --repeat 2 --write   # into BENCHMARKS.md

The schedulers are started as `kvmesh up --schedulers N` starts them
(scripts/cplib/scheduler_proc.py); synthetic engines (scripts/cplib/engines.py)
connect to every replica and send each hello, KV snapshot, load reports at
their interval and on change (with several replicas: at once on a start or
end, each listing only that replica's generations), KV events, as
services/engine/scheduler_link(s).py do; synthetic gateways
(scripts/cplib/gateways.py) admit through the gateway's own replica set and
scheduler client (each request on its rendezvous owner) with the real
message sequence (AdmitRequest -> Queued/Placed -> FirstToken -> RequestDone)
and hold each lease for a configurable time. Per step: offered vs sustained
admissions/s, decision latency p50/p99 at the gateway (Admit sent -> Placed
received) and from the schedulers' own decision histograms, the schedulers'
CPU per admission (their /proc utime + stime alone; summed and per replica),
each one's RSS; capacity = the highest step carried (>= 95% placed in the
window, none rejected) with p99 <= 5 ms. The drivers share the machine with
the schedulers: their CPU (the "driver cores" column) says how much of the
machine they took.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import os
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scripts.cplib.benchmarks_md import FleetResult, capacity_table, render_section, replace_section, summary_line
from scripts.cplib.figures import TABLE_HEADER, StepFigures, render_row
from scripts.cplib.fleet_run import FleetOptions, run_fleet
from scripts.cplib.plan import fleet_plan, step_rates
from scripts.cplib.workload import Workload


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engines", type=int, nargs="+", default=[64, 256, 1024], help="fleet sizes")
    p.add_argument("--schedulers", type=int, nargs="+", default=[1],
                   help="scheduler replicas, each fleet measured with each count")
    p.add_argument("--start-rate", type=float, default=10.0, help="first step, admissions/s")
    p.add_argument("--max-rate", type=float, default=12800.0, help="last step at most (x2 per step)")
    p.add_argument("--seconds", type=float, default=5.0, help="seconds of arrivals per step")
    p.add_argument("--gateways", type=int, default=2, help="synthetic gateway processes")
    p.add_argument("--engines-per-host", type=int, default=512, help="synthetic engines per process")
    p.add_argument("--hold-ms", type=float, nargs=2, default=[50.0, 200.0], metavar=("MIN", "MAX"),
                   help="lease held from Placed to RequestDone, uniform in [MIN, MAX] ms")
    p.add_argument("--first-token-ms", type=float, default=20.0, help="Placed -> FirstToken")
    p.add_argument("--groups", type=int, default=64, help="shared contexts (prefixes)")
    p.add_argument("--context-tokens", type=int, default=2000)
    p.add_argument("--repeat", type=int, default=1, help="runs per fleet size (the spread)")
    p.add_argument("--config", default=str(ROOT / "config" / "kvmesh.yaml"), help="mesh config the scheduler gets")
    p.add_argument("--log-level", default=os.environ.get("KVMESH_LOG_LEVEL", "INFO"),
                   help="the scheduler's (the launcher's default: INFO)")
    p.add_argument("--scheduler-cpu", type=int, default=None,
                   help="pin the scheduler(s) to this CPU and the synthetic processes to the others")
    p.add_argument("--write", action="store_true", help="write the results into BENCHMARKS.md")
    p.add_argument("--note", default="", help="text added under the table with --write")
    return p


def _load() -> str:
    one, five, fifteen = os.getloadavg()
    return f"{one:.2f} {five:.2f} {fifteen:.2f}"


def _print_row(figures: StepFigures, run: int) -> None:
    print(render_row(figures, run), flush=True)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    rates = tuple(step_rates(args.start_rate, args.max_rate))
    workload = Workload(groups=args.groups, context_tokens=args.context_tokens)
    started = datetime.datetime.now(datetime.UTC)
    load_before = _load()
    print(f"load average before: {load_before}", flush=True)
    results: list[FleetResult] = []
    for fleet in fleet_plan(args.engines, args.schedulers, args.repeat):
        opts = FleetOptions(
            engines=fleet.engines, rates=rates, seconds=args.seconds, gateways=args.gateways,
            engines_per_host=args.engines_per_host, hold_min=args.hold_ms[0] / 1000,
            hold_max=args.hold_ms[1] / 1000, first_token=args.first_token_ms / 1000, workload=workload,
            config=args.config, log_level=args.log_level, scheduler_cpu=args.scheduler_cpu,
            schedulers=fleet.schedulers)
        print(f"\n{fleet.engines} engines, {fleet.schedulers} scheduler(s), run {fleet.run} of {args.repeat}\n"
              f"{TABLE_HEADER}", flush=True)
        baseline, steps = run_fleet(opts, functools.partial(_print_row, run=fleet.run))
        results.append(FleetResult(baseline, steps))
        print(summary_line(results[-1]), flush=True)
    if len(args.schedulers) > 1:
        print(f"\n{capacity_table(results)}", flush=True)
    load_after = _load()
    print(f"\nload average after: {load_after}")
    if args.write:
        given = argv if argv is not None else sys.argv[1:]
        command = ".venv/bin/python scripts/bench_control_plane.py " + shlex.join(given)
        when = started.strftime("%Y-%m-%d %H:%M UTC")
        text = render_section(command.strip(), when, f"load average {load_before} before, {load_after} after",
                              results, args.note)
        path = ROOT / "BENCHMARKS.md"
        path.write_text(replace_section(path.read_text(), text))
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
