"""Fuzz every public and internal API of a running mesh with a bounded
number of cases (scripts/fuzz.py runs the same targets for long): no server
fault, no crashed service, nothing leaked, no traceback in any log."""

from __future__ import annotations

import pytest

from services.launcher.mesh import Mesh

from .targets import TARGETS, leak_problems, log_problems, run_target

# Small enough that the whole module runs in well under a minute.
EXAMPLES = {"http_schema": 40, "http_bodies": 60, "grpc_inference": 40, "grpc_admit": 40,
            "grpc_connect": 40, "grpc_engine": 40, "grpc_raw": 60}


@pytest.mark.parametrize("target", list(TARGETS))
def test_fuzz_target(fuzz_mesh: Mesh, target: str) -> None:
    report = run_target(target, fuzz_mesh, EXAMPLES[target])
    assert report.cases > 0, f"{target} tried no case"
    assert report.failure_count == 0, report.summary() + "\n" + "\n".join(report.failures)


def test_nothing_leaked_and_nothing_logged_a_traceback(fuzz_mesh: Mesh) -> None:
    """Runs after the targets (same module, file order): the mesh is idle
    again: 0 leases, 0 queued, no running generation, no pinned KV block."""
    assert leak_problems(fuzz_mesh) == []
    assert log_problems(fuzz_mesh) == []
