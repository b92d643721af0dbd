"""bench_peers with several scheduler replicas (scripts/peerslib/replicas.py,
issue 27): the meshes to start for `--schedulers`, the flags, the labels,
the launcher's replica names, and the table and verdicts comparing N
schedulers with the first count."""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

import pytest

from scripts.peerslib.replicas import (
    MeshRun,
    add_arguments,
    kvmesh_label,
    mesh_runs,
    ratio_table,
    scheduler_names,
    settle_arguments,
    verdicts,
)
from services.common.config import load_config
from services.launcher.mesh import Mesh, MeshOptions, Role

ROOT = Path(__file__).resolve().parents[2]
STICKY = "kvmesh:sticky_until_saturated"
TARGETS = [STICKY, "kvmesh:round_robin", "smg", "sglang-router"]


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--targets", nargs="*", default=list(TARGETS))
    add_arguments(p)
    args = p.parse_args(argv)
    settle_arguments(p, args)
    return args


def _row(policy: str, schedulers: int, p50: float, p90: float, p99: float) -> dict[str, Any]:
    """A run's summary as bench_peers keeps it (seconds), with its policy and N."""
    overall = {"ok": 10, "requests": 10, "ttft_s": {"p50": p50, "p90": p90, "p99": p99},
               "prefix_hit_rate": 0.5, "requests_per_s": 2.0}
    return {"label": kvmesh_label(policy, schedulers), "policy": policy, "schedulers": schedulers,
            "overall": overall}


# ---------------------------------------------------------------- flags and plan


def test_one_scheduler_and_every_target_by_default() -> None:
    args = _parse([])
    assert args.schedulers == [1]
    assert args.targets == TARGETS


def test_schedulers_take_a_list_and_kvmesh_only_drops_the_peers() -> None:
    args = _parse(["--schedulers", "1", "2", "3", "--kvmesh-only"])
    assert args.schedulers == [1, 2, 3]
    assert args.targets == [STICKY, "kvmesh:round_robin"]


@pytest.mark.parametrize("counts", [["0"], ["1", "1"], ["2", "-1"]])
def test_schedulers_refuse_a_zero_or_repeated_count(counts: list[str]) -> None:
    with pytest.raises(SystemExit):
        _parse(["--schedulers", *counts])


def test_peers_run_on_the_first_mesh_only() -> None:
    assert mesh_runs([1, 2, 3], TARGETS) == [
        MeshRun(1, TARGETS),
        MeshRun(2, [STICKY, "kvmesh:round_robin"]),
        MeshRun(3, [STICKY, "kvmesh:round_robin"]),
    ]


def test_a_later_mesh_with_nothing_to_run_is_not_started() -> None:
    assert mesh_runs([1, 2], ["smg"]) == [MeshRun(1, ["smg"])]
    # The first mesh always: the priority run (--priority-rate) uses it with no target.
    assert mesh_runs([2, 3], []) == [MeshRun(2, [])]


def test_one_scheduler_keeps_the_label_earlier_tables_used() -> None:
    assert kvmesh_label("sticky_until_saturated", 1) == STICKY
    assert kvmesh_label("sticky_until_saturated", 3) == f"{STICKY} x3 schedulers"


def test_scheduler_names_are_the_launchers() -> None:
    # switch_policy restarts each replica by these names: the launcher's own.
    with tempfile.TemporaryDirectory() as tmp:
        mesh = Mesh(load_config(ROOT / "config" / "kvmesh.yaml"),
                    MeshOptions(engines=1, backend="sim", model="tiny-llama", schedulers=3, free_ports=True,
                                run_dir=Path(tmp), envoy=False))
        launched = [s.name for s in mesh.specs() if s.role is Role.SCHEDULER]
        assert len(mesh.endpoints.schedulers) == 3
    assert scheduler_names(3) == launched
    assert scheduler_names(1) == ["scheduler"]


# ---------------------------------------------------------------- report


def test_ratio_table_one_line_per_count_against_the_first() -> None:
    rows = [_row("sticky_until_saturated", 1, 0.1, 0.2, 0.4),
            {"label": "smg", "overall": _row("x", 1, 1, 1, 1)["overall"]},   # a peer: not in the table
            _row("sticky_until_saturated", 2, 0.1, 0.21, 0.5),
            _row("sticky_until_saturated", 3, 0.1, 0.18, 0.4)]
    lines = ratio_table(rows).splitlines()
    assert lines[0].startswith("| policy | schedulers |")
    assert len(lines) == 2 + 3
    assert lines[2].split(" | ")[1:8] == ["1", "10/10", "100", "200", "400", "1.00", "1.00"]
    assert lines[2].split(" | ")[-1] == "- |"   # no floor in the row
    assert lines[3].split(" | ")[1:8] == ["2", "10/10", "100", "210", "500", "1.05", "1.25"]
    assert lines[4].split(" | ")[1:8] == ["3", "10/10", "100", "180", "400", "0.90", "1.00"]


def test_the_base_is_the_fewest_schedulers_whatever_the_order_run() -> None:
    rows = [_row("sticky_until_saturated", 3, 0.1, 0.3, 0.6), _row("sticky_until_saturated", 2, 0.1, 0.2, 0.4),
            _row("sticky_until_saturated", 1, 0.1, 0.2, 0.4)]
    rows[2]["floor"] = {"ttft_s": {"p90": 0.1}}
    lines = ratio_table(rows).splitlines()
    assert [line.split(" | ")[1] for line in lines[2:]] == ["1", "2", "3"]
    assert lines[2].split(" | ")[-1] == "2.00 |"   # p90 over its own floor's
    assert verdicts(rows)[1] == "sticky_until_saturated: 3 schedulers vs 1: p90 1.50x, p99 1.50x -- NOT within 10%"


def test_no_ratio_table_without_a_policy_run_with_two_counts() -> None:
    assert ratio_table([_row("sticky_until_saturated", 1, 0.1, 0.2, 0.4),
                        _row("round_robin", 2, 0.1, 0.2, 0.4)]) == ""
    assert verdicts([_row("sticky_until_saturated", 1, 0.1, 0.2, 0.4)]) == []


def test_verdicts_hold_both_p90_and_p99_to_ten_percent() -> None:
    rows = [_row("sticky_until_saturated", 1, 0.1, 0.2, 0.4),
            _row("sticky_until_saturated", 2, 0.1, 0.22, 0.44),   # exactly 10% slower: within
            _row("sticky_until_saturated", 3, 0.1, 0.2, 0.45)]    # p99 12.5% slower: not
    got = verdicts(rows)
    assert got == [
        "sticky_until_saturated: 2 schedulers vs 1: p90 1.10x, p99 1.10x -- within 10%",
        "sticky_until_saturated: 3 schedulers vs 1: p90 1.00x, p99 1.12x -- NOT within 10%",
    ]


def test_a_count_with_no_ttft_is_not_within() -> None:
    rows = [_row("sticky_until_saturated", 1, 0.1, 0.2, 0.4), _row("sticky_until_saturated", 2, 0.1, 0.2, 0.4)]
    rows[1]["overall"]["ttft_s"] = {}
    assert verdicts(rows) == ["sticky_until_saturated: 2 schedulers vs 1: p90 -x, p99 -x -- NOT within 10%"]
