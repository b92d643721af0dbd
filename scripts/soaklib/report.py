"""The soak's verdict: requests by kind and outcome, the batches, the faults
made, each process series' slopes against their bounds; printed, and
written as JSON. Exit status 1 on any lost request or batch line, a slope
over its bound, or a fault loop that stopped."""

from __future__ import annotations

import collections
import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scripts.chaoslib.outcomes import Tally

from .batches import BatchTally
from .series import Series, Verdict

__all__ = ["Result", "failures", "report", "totals"]


@dataclass
class Result:
    ns: dict[str, Any]
    took: float
    tallies: dict[str, Tally]
    batch: BatchTally
    faults: Tally              # actions and the gateways' counters
    made: list[str]
    fault_loop_failed: str
    verdicts: list[Verdict]
    # The raw samples behind the verdicts (in the JSON, for a second look).
    series: list[Series] = dataclasses.field(default_factory=list)


def totals(tallies: dict[str, Tally]) -> dict[str, int]:
    return {"sent": sum(t.sent for t in tallies.values()),
            "completed": sum(t.completed for t in tallies.values()),
            "rejected": sum(sum(t.rejected.values()) for t in tallies.values()),
            "lost": sum(sum(t.lost.values()) for t in tallies.values()),
            "resumed": sum(t.resumed for t in tallies.values()),
            "cache_hits": int(sum(t.counters.get("cache hits", 0) for t in tallies.values()))}


def failures(result: Result) -> list[str]:
    """Why the soak fails; empty when it passes."""
    out = []
    lost = totals(result.tallies)["lost"]
    if lost:
        out.append(f"{lost} requests lost")
    if result.batch.lost:
        out.append(f"{sum(result.batch.lost.values())} batch lines lost")
    out += [f"{v.name} (pid {v.pid}): {', '.join(v.over)}" for v in result.verdicts if v.over]
    if result.fault_loop_failed:
        out.append(f"the fault loop stopped: {result.fault_loop_failed}")
    return out


def _tally_json(t: Tally) -> dict[str, Any]:
    return {"sent": t.sent, "completed": t.completed, "resumed": t.resumed, "resent": t.resent,
            "rejected": dict(t.rejected), "lost": dict(t.lost), "counters": dict(t.counters)}


def _print(result: Result, why: list[str]) -> None:
    print("soak: faults:")
    for line in result.faults.actions:
        print(f"  {line}")
    print(f"soak: {len(result.made)} faults: {dict(collections.Counter(result.made))}")
    total = totals(result.tallies)
    print(f"soak: {result.took / 60:.1f} min of load: " + ", ".join(f"{k} {v}" for k, v in total.items()))
    for name, t in result.tallies.items():
        hits = f", cache hits {t.counters['cache hits']:.0f}" if t.counters.get("cache hits") else ""
        print(f"  {name:24s} sent {t.sent:6d} completed {t.completed:6d} (resumed {t.resumed}) rejected "
              f"{sum(t.rejected.values()):4d} lost {sum(t.lost.values())}{hits}")
        for reason, n in [*t.rejected.most_common(), *(("LOST " + r, n) for r, n in t.lost.most_common())]:
            print(f"      {n}: {reason}")
    b = result.batch
    print(f"soak: batches: {b.lines_ok}/{b.lines} lines answered once; lost {sum(b.lost.values())}")
    for line in [*b.batches, *(f"LOST {n}: {r}" for r, n in b.lost.items())]:
        print(f"  {line}")
    for series, value in sorted(result.faults.counters.items()):
        print(f"  gateway {series} = {value:.0f}")
    print("soak: resources (slope after warm-up, per hour; '-' = too short to judge):")
    for v in result.verdicts:
        mark = "OVER" if v.over else "ok" if v.judged else "-"
        print(f"  {v.name:10s} pid {v.pid:7d} {v.first / 60:5.1f}-{v.last / 60:5.1f} min, fit from "
              f"{v.fit_from / 60:5.1f} ({v.fitted:3d} samples): RSS {v.rss_mib[0]:6.1f}->{v.rss_mib[1]:6.1f} MiB "
              f"{v.rss_mib_per_hour:+7.2f} MiB/h (bound {v.bound.rss_mib:g}), fds {v.fds[0]}->{v.fds[1]} "
              f"{v.fds_per_hour:+7.2f}/h (bound {v.bound.fds:g})  {mark}")
    print("soak: " + ("PASS" if not why else "FAIL: " + "; ".join(why)), flush=True)


def report(result: Result, out: Path) -> int:
    why = failures(result)
    _print(result, why)
    data = {
        "args": result.ns, "minutes_of_load": round(result.took / 60, 2), "totals": totals(result.tallies),
        "kinds": {name: _tally_json(t) for name, t in result.tallies.items()},
        "batch": {"lines": result.batch.lines, "lines_ok": result.batch.lines_ok, "lost": dict(result.batch.lost),
                  "batches": result.batch.batches},
        "faults": {"made": dict(collections.Counter(result.made)), "actions": result.faults.actions,
                   "gateway_counters": dict(result.faults.counters)},
        "resources": [{**dataclasses.asdict(v), "over": v.over} for v in result.verdicts],
        "samples": {f"{s.name} {s.pid}": [[round(x.t, 1), round(x.rss_mib, 2), x.fds] for x in s.samples]
                    for s in result.series},
        "failures": why, "passed": not why,
    }
    out.write_text(json.dumps(data, indent=2) + "\n")
    print(f"soak: result written to {out}")
    return 1 if why else 0
