"""The local actuator of `kvmesh up --autoscale` (services/launcher/
autoscale.py) against a fake mesh and a fake scheduler, on a fake clock:
one step per interval, clamped to MIN:MAX, drain before stop, a draining
engine taken back before a cold start; and the --autoscale options."""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from services.common.clock import FakeClock
from services.common.config import ConfigError, load_config
from services.launcher.autoscale import EngineFigures, LocalAutoscaler, parse_bounds
from services.launcher.children import ChildSpec, Role
from services.launcher.options import MeshOptions
from services.launcher.resolve import ROOT, resolve_config


@dataclass
class FakeMesh:
    running: set[str] = field(default_factory=set)
    healthy: set[str] = field(default_factory=set)
    launched: list[str] = field(default_factory=list)
    stopped: list[str] = field(default_factory=list)

    def is_running(self, name: str) -> bool:
        return name in self.running

    def launch(self, spec: ChildSpec) -> None:
        self.running.add(spec.name)
        self.launched.append(spec.name)

    def started(self, name: str) -> bool:
        return name in self.healthy

    def terminate(self, name: str) -> None:
        self.stopped.append(name)
        self.running.discard(name)      # exits at once


@dataclass
class FakeScheduler:
    desired: int = 1
    leases: dict[str, int] = field(default_factory=dict)
    drains: list[tuple[str, bool]] = field(default_factory=list)

    def read(self) -> tuple[int | None, str, dict[str, EngineFigures]]:
        return self.desired, "test", {e: EngineFigures(n, 0) for e, n in self.leases.items()}

    def drain(self, engine_id: str, on: bool) -> None:
        self.drains.append((engine_id, on))

    def close(self) -> None:
        pass


def _actuator(bounds: tuple[int, int], running: int) -> tuple[LocalAutoscaler, FakeMesh, FakeScheduler, FakeClock]:
    mesh = FakeMesh(running={f"engine-{i}" for i in range(running)})
    sched, clock = FakeScheduler(), FakeClock()
    specs = [ChildSpec(f"engine-{i}", Role.ENGINE, [], [], {}, 1.0) for i in range(bounds[1])]
    scaler = LocalAutoscaler(mesh, sched, specs, bounds, 1.0, clock=clock, out=io.StringIO())
    return scaler, mesh, sched, clock


def _pass(scaler: LocalAutoscaler, clock: FakeClock, seconds: float = 1.0) -> None:
    clock.advance(seconds)
    scaler.check()


def test_out_one_engine_per_interval_up_to_max() -> None:
    scaler, mesh, sched, clock = _actuator((1, 3), running=1)
    sched.desired = 9
    _pass(scaler, clock)
    assert mesh.launched == ["engine-1"] and scaler.active() == 2    # starting counts as active
    _pass(scaler, clock, 0.5)
    assert mesh.launched == ["engine-1"]                              # not before the next interval
    _pass(scaler, clock, 0.5)
    assert mesh.launched == ["engine-1", "engine-2"]
    _pass(scaler, clock)
    assert mesh.launched == ["engine-1", "engine-2"]                  # clamped to MAX
    mesh.healthy |= {"engine-1", "engine-2"}
    _pass(scaler, clock)
    assert any("engine-2 serving" in s for s in scaler.steps)


def test_in_drains_then_stops_once_its_requests_finished_then_undrains() -> None:
    scaler, mesh, sched, clock = _actuator((1, 3), running=3)
    sched.desired, sched.leases = 0, {"engine-2": 2}
    _pass(scaler, clock)
    assert sched.drains == [("engine-2", True)] and not mesh.stopped   # drained, still finishing
    _pass(scaler, clock, 0.5)
    assert not mesh.stopped
    sched.leases["engine-2"] = 0
    _pass(scaler, clock, 0.4)
    assert mesh.stopped == ["engine-2"]
    _pass(scaler, clock, 0.1)
    assert ("engine-2", False) in sched.drains and any("engine-2 left" in s for s in scaler.steps)
    _pass(scaler, clock)
    _pass(scaler, clock)
    assert scaler.active() == 1                                         # never below MIN


def test_a_draining_engine_is_taken_back_before_a_cold_start() -> None:
    scaler, mesh, sched, clock = _actuator((1, 3), running=2)
    sched.desired, sched.leases = 1, {"engine-1": 5}
    _pass(scaler, clock)
    sched.desired = 2
    _pass(scaler, clock)
    assert sched.drains == [("engine-1", True), ("engine-1", False)] and not mesh.launched


def test_in_stops_a_starting_engine_before_draining_a_serving_one() -> None:
    scaler, mesh, sched, clock = _actuator((1, 3), running=1)
    sched.desired = 3
    _pass(scaler, clock)
    _pass(scaler, clock)
    assert mesh.launched == ["engine-1", "engine-2"]
    sched.desired = 1
    _pass(scaler, clock)
    assert mesh.stopped == ["engine-2"] and not sched.drains       # engine-0 keeps serving
    _pass(scaler, clock)
    assert mesh.stopped == ["engine-2", "engine-1"] and not [d for d in sched.drains if d[1]]   # none drained


def test_autoscale_bounds_and_options(tmp_path: Path) -> None:
    assert parse_bounds("0:2") == (0, 2) and parse_bounds("1:8") == (1, 8)
    for bad in ("2", "3:1", "0:0", "a:b", "-1:2"):
        with pytest.raises(ValueError):
            parse_bounds(bad)
    assert MeshOptions(autoscale=(1, 4)).initial_engines(4) == 1
    assert MeshOptions(autoscale=(0, 4), engines=9).initial_engines(4) == 4
    assert MeshOptions(engines=2).initial_engines(2) == 2
    base = load_config(ROOT / "config" / "kvmesh.yaml")
    config, _ = resolve_config(base, MeshOptions(autoscale=(0, 3), backend="sim", free_ports=True, run_dir=tmp_path))
    s = config.scheduler.scaling
    assert config.engines.count == 3 and s.enabled and (s.min_engines, s.max_engines) == (0, 3)
    with pytest.raises(ConfigError):
        resolve_config(base, MeshOptions(autoscale=(2, 1), run_dir=tmp_path))
