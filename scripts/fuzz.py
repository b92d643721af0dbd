"""Long fuzzing runs against a fresh mesh (real processes, free ports).

    .venv/bin/python scripts/fuzz.py --examples 2000 [--targets http_bodies,grpc_engine] [--seed 1]

Runs each target of tests/fuzz/targets.py with N hypothesis examples,
prints per target the cases tried and failures found (with the first
failing inputs), then checks nothing leaked (leases, queue, KV blocks,
running generations) and no service logged a traceback. Exit status 1 when
anything failed. The pytest suite (tests/fuzz) runs the same targets with
small counts.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from tests.fuzz.targets import TARGETS, leak_problems, log_problems, run_target, start_fuzz_mesh


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--examples", type=int, default=500, help="hypothesis examples per target")
    parser.add_argument("--targets", default=",".join(TARGETS), help="comma-separated; default all")
    parser.add_argument("--seed", type=int, default=None, help="derandomize (same cases every run)")
    parser.add_argument("--keep-logs", action="store_true", help="print the mesh's log directory")
    args = parser.parse_args()
    names = [n for n in args.targets.split(",") if n]
    unknown = [n for n in names if n not in TARGETS]
    if unknown:
        parser.error(f"unknown target(s) {unknown}; known: {list(TARGETS)}")
    run_dir = Path(tempfile.mkdtemp(prefix="kvmesh-fuzz-"))
    mesh = start_fuzz_mesh(run_dir)
    failed = 0
    total = 0
    try:
        for name in names:
            started = time.monotonic()
            report = run_target(name, mesh, args.examples, args.seed)
            total += report.cases
            failed += report.failure_count
            print(f"{report.summary()} ({time.monotonic() - started:.1f} s)", flush=True)
            for failure in report.failures[:10]:
                print(f"    - {failure}", flush=True)
        leaks = leak_problems(mesh)
        logs = log_problems(mesh)
        for problem in leaks + logs:
            print(f"after the run: {problem}", flush=True)
        failed += len(leaks) + len(logs)
        print(f"total: {total} cases, {failed} failures; leaks: {len(leaks)}; logged tracebacks: {len(logs)}")
    finally:
        mesh.stop_all()
        if args.keep_logs:
            print(f"logs: {mesh.log_dir}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
