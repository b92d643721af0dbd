"""`kvmesh dashboards ...`: render the boards and rules, draw them from a
Prometheus, or do both on a local sim mesh.

    kvmesh dashboards render [--check]                       rewrite (or check) the generated files
    kvmesh dashboards snapshot --prometheus URL --out DIR    one PNG per board from Prometheus data
    kvmesh dashboards demo --out DIR                         sim mesh + Prometheus + load -> PNGs
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from services.common.config import load_config

__all__ = ["main"]

ROOT = Path(__file__).resolve().parents[2]


def _render(ns: argparse.Namespace) -> int:
    from services.observability.render import stale_files, write_files

    config = load_config(ns.config)
    if ns.check:
        stale = stale_files(ROOT, config)
        for path in stale:
            print(f"stale: {path} (run `kvmesh dashboards render`)", file=sys.stderr)
        return 1 if stale else 0
    for path in write_files(ROOT, config):
        print(f"wrote {path}")
    return 0


def _snapshot(ns: argparse.Namespace) -> int:
    from services.observability.snapshot import snapshot_boards

    for path in snapshot_boards(ns.prometheus, Path(ns.out), minutes=ns.minutes, rate_interval=ns.rate_interval):
        print(f"wrote {path}")
    return 0


def _demo(ns: argparse.Namespace) -> int:
    from services.observability.demo import run_demo

    for path in run_demo(load_config(ns.config), Path(ns.out), seconds=ns.seconds):
        print(f"wrote {path}")
    return 0


def main(argv: list[str] | None = None, config: str | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvmesh dashboards", description="Grafana boards and alert rules")
    parser.set_defaults(config=config or str(ROOT / "config" / "kvmesh.yaml"))
    sub = parser.add_subparsers(dest="command", required=True)
    render = sub.add_parser("render", help="write the boards and rule files (thresholds: the config's `alerts`)")
    render.add_argument("--check", action="store_true", help="only report stale files (exit 1 if any)")
    render.set_defaults(func=_render)
    snap = sub.add_parser("snapshot", help="draw every board from a Prometheus as a PNG")
    snap.add_argument("--prometheus", required=True, help="Prometheus base URL, e.g. http://127.0.0.1:9090")
    snap.add_argument("--out", default="artifacts/dashboards", help="folder for <board>.png")
    snap.add_argument("--minutes", type=float, default=10.0, help="time range ending now (default 10)")
    snap.add_argument("--rate-interval", default="1m",
                      help="what $__rate_interval stands for (default 1m: four 15 s scrapes)")
    snap.set_defaults(func=_snapshot)
    demo = sub.add_parser("demo", help="start a sim mesh and a local Prometheus, run mixed load, draw the boards")
    demo.add_argument("--out", default="artifacts/dashboards", help="folder for <board>.png")
    demo.add_argument("--seconds", type=float, default=150.0, help="seconds of load (default 150)")
    demo.set_defaults(func=_demo)
    ns = parser.parse_args(argv)
    return int(ns.func(ns))
