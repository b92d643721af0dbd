"""bench_peers with several scheduler replicas (`--schedulers 1 2 3`, issue 27).

kvmesh runs on one mesh per scheduler count N, each started as `kvmesh up
--schedulers N` starts it (one gateway: it spreads requests over the
replicas by rendezvous hashing of the request id, README "Several
schedulers"); the peer routers run once, on the first mesh (they never talk
to a scheduler). Every row keeps its policy and N, so the comparison table
groups by them, not by parsing labels.

The comparison: for each kvmesh policy run with more than one N, TTFT
p50/p90/p99 per N and the ratio of p90 and p99 to the fewest schedulers'
(N=1 when listed); > 1 = slower than one scheduler. Issue 27 asks for each
ratio <= 1 + TOLERANCE. The meshes run in the order listed, so `3 2 1`
runs the same comparison with the drift of a shared machine the other way.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

__all__ = ["TOLERANCE", "MeshRun", "add_arguments", "kvmesh_label", "mesh_runs", "ratio_table", "scheduler_names",
           "settle_arguments", "verdicts"]

# Issue 27: "placement quality with 2 and 3 schedulers within 10% of one at p90 and p99".
TOLERANCE = 0.10
_PERCENTILES = ("p50", "p90", "p99")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """bench_peers' --schedulers and --kvmesh-only."""
    p.add_argument("--schedulers", type=int, nargs="+", default=[1],
                   help="kvmesh's scheduler replicas: one mesh per count, as `kvmesh up --schedulers N` "
                        "in this order (e.g. 1 2 3, or 3 2 1; peers run on the first mesh only), compared with the "
                        "fewest")
    p.add_argument("--kvmesh-only", action="store_true", help="leave the peer routers out of --targets")


def settle_arguments(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--kvmesh-only applied to args.targets; --schedulers checked (distinct counts >= 1)."""
    if args.kvmesh_only:
        args.targets = [t for t in args.targets if t.startswith("kvmesh:")]
    if any(n < 1 for n in args.schedulers) or len(set(args.schedulers)) != len(args.schedulers):
        p.error(f"--schedulers: distinct counts >= 1, got {args.schedulers}")


@dataclass(frozen=True)
class MeshRun:
    """One mesh of the benchmark: its scheduler count and the targets run on it."""

    schedulers: int
    targets: list[str]


def mesh_runs(schedulers: list[int], targets: list[str]) -> list[MeshRun]:
    """One mesh per scheduler count, in the order given: every kvmesh
    target on each, the peers on the first only (a peer never talks to a
    scheduler, so another N would only repeat it). The first mesh always
    (the priority run uses it), a later one only with a target to run."""
    out: list[MeshRun] = []
    for i, n in enumerate(schedulers):
        run = [t for t in targets if i == 0 or t.startswith("kvmesh:")]
        if run or i == 0:
            out.append(MeshRun(n, run))
    return out


def kvmesh_label(policy: str, schedulers: int) -> str:
    """A kvmesh run's label: `kvmesh:<policy>` with one scheduler (the
    label every earlier table used), `kvmesh:<policy> x<N> schedulers` otherwise."""
    base = f"kvmesh:{policy}"
    return base if schedulers == 1 else f"{base} x{schedulers} schedulers"


def scheduler_names(schedulers: int) -> list[str]:
    """The launcher's child names of N scheduler replicas (services/launcher/specs.py)."""
    return ["scheduler", *(f"scheduler-{r}" for r in range(1, schedulers))]


def _ms(block: dict[str, Any] | None, p: str) -> float | None:
    if block is None:
        return None
    v = block["ttft_s"].get(p)
    return None if v is None else v * 1000


def _ratio(mine: float | None, base: float | None) -> float | None:
    return None if mine is None or not base else mine / base


def _groups(rows: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """kvmesh rows by policy, each list by scheduler count, fewest first (the
    base); only policies run with more than one N."""
    by: dict[str, list[dict[str, Any]]] = {}
    for s in rows:
        if "policy" in s and "schedulers" in s:
            by.setdefault(s["policy"], []).append(s)
    return {p: sorted(g, key=lambda s: s["schedulers"]) for p, g in by.items()
            if len({s["schedulers"] for s in g}) > 1}


def _fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def ratio_table(rows: list[dict[str, Any]]) -> str:
    """Per kvmesh policy run with several scheduler counts: one line per N,
    TTFT p50/p90/p99 ms and p90, p99 over the fewest N's, and p90 over the
    run's own floor (bench_peers' "x floor at p90": placement quality on
    that run's very requests) ("" when no policy was run with more than one N)."""
    groups = _groups(rows)
    if not groups:
        return ""
    head = ["policy", "schedulers", "ok", "TTFT p50 ms", "TTFT p90 ms", "TTFT p99 ms", "p90 / base",
            "p99 / base", "prefix hit rate", "req/s", "x floor at p90"]
    out = [head, ["---"] * len(head)]
    for policy, group in groups.items():
        base = group[0]["overall"]
        for s in group:
            o = s["overall"]
            out.append([policy, str(s["schedulers"]), f"{o['ok']}/{o['requests']}",
                        *(_fmt(_ms(o, p), ".0f") for p in _PERCENTILES),
                        *(_fmt(_ratio(_ms(o, p), _ms(base, p)), ".2f") for p in ("p90", "p99")),
                        _fmt(o["prefix_hit_rate"], ".1%"), _fmt(o["requests_per_s"], ".2f"),
                        _fmt(_ratio(_ms(o, "p90"), _ms(s.get("floor"), "p90")), ".2f")])
    return "\n".join("| " + " | ".join(r) + " |" for r in out)


def verdicts(rows: list[dict[str, Any]], tolerance: float = TOLERANCE) -> list[str]:
    """One line per (policy, N beyond the base): whether its p90 and p99 are
    within `tolerance` of the base N's."""
    lines = []
    for policy, group in _groups(rows).items():
        base = group[0]
        for s in group[1:]:
            ratios = {p: _ratio(_ms(s["overall"], p), _ms(base["overall"], p)) for p in ("p90", "p99")}
            ok = all(r is not None and r <= 1 + tolerance + 1e-9 for r in ratios.values())  # 0.22 / 0.2 > 1.1 in floats
            shown = ", ".join(f"{p} {_fmt(r, '.2f')}x" for p, r in ratios.items())
            lines.append(f"{policy}: {s['schedulers']} schedulers vs {base['schedulers']}: {shown} -- "
                         f"{'within' if ok else 'NOT within'} {tolerance:.0%}")
    return lines
