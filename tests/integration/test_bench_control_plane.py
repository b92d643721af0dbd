"""scripts/bench_control_plane.py end to end, small: a real scheduler
process, 8 synthetic engines in one host process and one synthetic gateway,
two steps of one second. Every admission is placed, the scheduler's CPU and
decision histogram are read, the engines' reports reach it. Then the same
with two scheduler replicas and one step."""

from __future__ import annotations

import math
from pathlib import Path

from scripts.cplib.figures import StepFigures
from scripts.cplib.fleet_run import FleetOptions, run_fleet
from scripts.cplib.workload import Workload

ROOT = Path(__file__).resolve().parents[2]


def test_a_small_fleet_is_measured() -> None:
    seen: list[StepFigures] = []
    opts = FleetOptions(engines=8, rates=(20.0, 40.0), seconds=1.0, gateways=1, engines_per_host=8,
                        workload=Workload(groups=8), config=str(ROOT / "config" / "kvmesh.yaml"),
                        settle_seconds=0.5)
    baseline, steps = run_fleet(opts, seen.append)
    assert seen == steps and [s.offered for s in steps] == [20.0, 40.0]
    assert baseline.engines == 8 and baseline.rss_fleet_kib > 0
    for s in steps:
        assert s.sent > 0 and s.placed == s.sent and s.unplaced == 0 and s.rejected == 0
        assert 0 < s.p50_ms <= s.p99_ms < 1000
        assert s.sched_cpu_s > 0 and s.rss_kib > 0 and s.engine_messages > 0
        assert not math.isnan(s.hist_p50_ms)


def test_two_schedulers_share_a_small_fleet() -> None:
    """Two real replicas: every engine registers with both, each admission
    goes to its rendezvous owner and is placed, both replicas place some,
    and each one's CPU and RSS are read."""
    opts = FleetOptions(engines=8, rates=(40.0,), seconds=1.0, gateways=1, engines_per_host=8,
                        workload=Workload(groups=8), config=str(ROOT / "config" / "kvmesh.yaml"),
                        settle_seconds=0.5, schedulers=2)
    baseline, steps = run_fleet(opts, lambda _: None)
    assert baseline.schedulers == 2 and len(baseline.replica_rss_fleet_kib) == 2
    (s,) = steps
    assert s.sent > 0 and s.placed == s.sent and s.unplaced == 0 and s.rejected == 0 and s.moved == 0
    assert s.schedulers == 2 and sum(s.replica_placed) == s.placed and min(s.replica_placed) > 0
    assert len(s.replica_cpu_s) == 2 and min(s.replica_cpu_s) > 0 and s.sched_cpu_s == sum(s.replica_cpu_s)
    assert min(s.replica_rss_kib) > 0 and s.engine_messages > 0 and not math.isnan(s.hist_p50_ms)
