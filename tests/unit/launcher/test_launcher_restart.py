"""`kvmesh up`'s restart policy: the scheduler and the engines are restarted
(soft state; an engine exits by itself when its backend died or hung), with
backoff when one keeps crashing."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.launcher.mesh import Mesh, MeshOptions, RestartPolicy, Role
from services.launcher.up import _RESTART_BACKOFF_MAX, _RESTART_STABLE_SECONDS, _Backoff

ROOT = Path(__file__).resolve().parents[3]


def test_backoff_restarts_at_once_then_doubles_then_resets() -> None:
    b = _Backoff()
    assert b.next_delay(100.0) == 0.0       # first crash: restart now
    b.last_restart = 100.0
    assert b.next_delay(101.0) == 1.0       # crashed again soon after
    b.last_restart = 102.0
    assert b.next_delay(103.0) == 2.0
    for _ in range(10):
        b.last_restart = 104.0
        delay = b.next_delay(105.0)
    assert delay == _RESTART_BACKOFF_MAX
    b.last_restart = 200.0
    assert b.next_delay(200.0 + _RESTART_STABLE_SECONDS + 1) == 0.0  # it ran long enough


def test_scheduler_and_engines_restart_always_others_never(tmp_path: Path) -> None:
    from services.common.config import load_config

    if not (ROOT / ".models" / "tiny-llama").is_dir():
        pytest.skip(".models/tiny-llama is missing: run `make setup`")
    config = load_config(ROOT / "config" / "kvmesh.yaml")
    mesh = Mesh(config, MeshOptions(engines=1, model="tiny-llama", envoy=False, free_ports=True, run_dir=tmp_path))
    policies = {spec.role: spec.restart for spec in mesh.specs()}
    assert policies[Role.SCHEDULER] is RestartPolicy.ALWAYS
    assert policies[Role.ENGINE] is RestartPolicy.ALWAYS
    assert policies[Role.GATEWAY] is RestartPolicy.NEVER
