"""Issue 27's short-request run, kvmesh against smg over the same engines,
from one command: the ratio of one run.

    .venv/bin/python scripts/bench_short.py [--rounds 2] [--seconds 20]    # needs scripts/setup_peers.sh

One mesh as `kvmesh up` starts it (default config, INFO logging): Envoy, 1
gateway, 1 scheduler, 2 zero-cost sim engines (`speed_factor 0`). 64
closed-loop clients (`--clients`) send non-streamed `/v1/completions` of 4
tokens back to back (scripts/path_cost.py's loop, 2 s unmeasured, then
`--seconds` measured), alternately through kvmesh (Envoy's listener) and
through smg 1.13 (`smg launch --policy cache_aware`, SGLang's gateway, a Rust
router) in front of the SAME two engines' own OpenAI endpoints, `--rounds`
times each (kvmesh first in odd rounds, smg first in even ones, against the
machine's drift). For each run: req/s, latency p50/p99, and CPU ms per
request of each process (utime + stime of all its threads over the window /
requests completed): kvmesh's gateway, scheduler and Envoy, or smg; the
engines in both. The clients run in this process, on the same cores.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import cast

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import bench_peers as bp
import path_cost as pc

from services.common.affinity import descendants
from services.launcher.mesh import Mesh


def _run(target: Mesh, groups: dict[str, list[int]], args: argparse.Namespace) -> dict[str, float]:
    window: list[dict[str, pc.Sample]] = []
    result = asyncio.run(pc.closed_loop(target, args, groups, window))
    n = max(result.ok, 1)
    lat = sorted(result.latencies) or [0.0]
    out = {"req/s": result.ok / result.seconds, "errors": float(result.errors),
           "p50 ms": lat[len(lat) // 2] * 1000, "p99 ms": lat[int(len(lat) * 0.99)] * 1000,
           "load": os.getloadavg()[0]}
    for key in groups:
        out[f"{key} ms"] = (window[1][key].cpu_s - window[0][key].cpu_s) * 1000 / n
    return out


def _line(name: str, r: dict[str, float]) -> str:
    cpu = ", ".join(f"{k[:-3]} {v:.2f}" for k, v in r.items() if k.endswith(" ms") and not k.startswith("p"))
    return (f"| {name} | {r['req/s']:.0f} | {r['p50 ms']:.1f} / {r['p99 ms']:.1f} | {cpu} | "
            f"{r['errors']:.0f} | {r['load']:.1f} |")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--warm-seconds", type=float, default=2.0)
    args = p.parse_args(argv)
    if not (bp.PEER_BIN / "smg").exists():
        print("smg is not installed: run scripts/setup_peers.sh", file=sys.stderr)
        return 2
    rows: dict[str, list[dict[str, float]]] = {"kvmesh": [], "smg": []}
    with tempfile.TemporaryDirectory(prefix="kvmesh-short-") as tmp:
        mesh = pc.short_mesh(Path(tmp), engine_http=True)
        mesh.start()
        peer = bp.Peer("smg", bp.engine_urls(mesh), Path(tmp))
        try:
            peer.wait_ready()
            kvmesh_groups = pc.process_groups(mesh)
            engines = {"engines": kvmesh_groups["engines"]}
            smg_groups = {**engines, "smg": [peer.proc.pid, *descendants(peer.proc.pid)]}
            # smg's URL and no key, as the loop reads a mesh (endpoints.public_http, api_key).
            smg = cast(Mesh, SimpleNamespace(endpoints=SimpleNamespace(public_http=peer.url), api_key="none"))
            for i in range(args.rounds):
                order = [("kvmesh", mesh, kvmesh_groups), ("smg", smg, smg_groups)]
                for name, target, groups in order if i % 2 == 0 else order[::-1]:
                    rows[name].append(_run(target, groups, args))
                    print(_line(f"{name}, round {i + 1}", rows[name][-1]), flush=True)
        finally:
            peer.stop()
            mesh.stop_all()
    print("\n| target, round | req/s | latency p50 / p99 ms | CPU ms per request | errors | load |")
    print("|---|---:|---|---|---:|---:|")
    for name, runs in rows.items():
        for i, r in enumerate(runs):
            print(_line(f"{name}, round {i + 1}", r))
    ratios = [s["req/s"] / k["req/s"] for k, s in zip(rows["kvmesh"], rows["smg"], strict=True) if k["req/s"]]
    mesh_ms = [r["gateway-0 ms"] + r["scheduler ms"] for r in rows["kvmesh"]]
    print(f"\nsmg / kvmesh req/s per round: {', '.join(f'{x:.2f}x' for x in ratios)} "
          f"(median {statistics.median(ratios):.2f}x; the issue's bar: <= 1.5x)")
    smg_ms = [r["smg ms"] for r in rows["smg"]]
    print(f"kvmesh gateway + scheduler CPU ms per request: {', '.join(f'{x:.2f}' for x in mesh_ms)} "
          f"(the issue's bar: <= 1.5 ms); smg's: {', '.join(f'{x:.2f}' for x in smg_ms)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
