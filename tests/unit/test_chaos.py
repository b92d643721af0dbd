"""The chaos run's logic without a mesh (scripts/chaos.py, scripts/chaoslib/):
the mixed-priority jobs, first-token accounting and the paired comparison,
the fault cadence, and the scheduler-replica faults on a fake mesh."""

from __future__ import annotations

import random
import sys
import time
from types import SimpleNamespace
from typing import Any, cast

import pytest

from scripts.chaoslib import schedulers
from scripts.chaoslib.latency import compare_lines, percentile, ttft_lines
from scripts.chaoslib.loopback import Chaos
from scripts.chaoslib.outcomes import Job, Tally, make_jobs, merged, record
from services.launcher.children import MeshError, Role
from services.launcher.mesh import Mesh
from tests._scripts import load_script
from tests.netns.client import Stream


def test_percentiles_are_nearest_rank() -> None:
    values = [float(i) for i in range(1, 301)]
    assert percentile(values, 99) == 297.0               # a time some request really waited
    assert percentile(values, 50) == 150.0
    assert percentile([0.2], 99) == 0.2
    assert percentile([], 99) is None


def test_jobs_without_a_mix_are_the_ones_before_priorities() -> None:
    plain = make_jobs(random.Random(7), 40, 120)
    assert all(j.priority is None for j in plain)
    assert make_jobs(random.Random(7), 40, 120) == plain  # the same seed draws the same requests
    mixed = make_jobs(random.Random(7), 400, 120, (0.2, 0.3, 0.5))
    assert [j.prompt for j in mixed[:40]] == [j.prompt for j in plain]
    counts = [sum(j.priority == p for j in mixed) for p in range(3)]
    assert all(abs(c / 400 - w) < 0.08 for c, w in zip(counts, (0.2, 0.3, 0.5), strict=True)), counts


def _done(text: str, first_at: float) -> Stream:
    return Stream("p", 8, status=200, text=text, finish_reason="length", done=True, first_text_at=first_at)


def test_first_token_times_are_kept_per_class_for_completed_requests_only() -> None:
    tally = Tally()
    record(tally, _done("abc", 10.25), "abc", Job("p", 8, priority=0), sent_at=10.0)
    record(tally, _done("abc", 10.5), "abc", Job("p", 8, priority=2), sent_at=10.0)
    record(tally, _done("xyz", 10.1), "abc", Job("p", 8, priority=0), sent_at=10.0)   # wrong text: lost
    record(tally, _done("abc", 11.0), "abc", Job("p", 8), sent_at=10.0)
    assert dict(tally.ttft) == {"P0": [0.25], "P2": [0.5], "default": [1.0]}
    assert tally.completed == 3 and sum(tally.lost.values()) == 1
    assert ttft_lines(tally)[0] == "TTFT P0: 1 completed, p50 250 ms, p99 250 ms, worst 250 ms"


def test_the_paired_comparison_gives_the_p0_ratio_and_both_runs_counts() -> None:
    base, chaos = Tally(sent=100), Tally(sent=98)
    base.ttft["P0"] = [0.1] * 99 + [0.2]
    chaos.ttft["P0"] = [0.1] * 97 + [0.2, 0.3, 0.3]
    chaos.rejected["http 503 x"] += 1
    lines = compare_lines(base, chaos)
    assert lines[0] == ("paired: without faults sent 100, lost 0, refused 0; with faults sent 98, lost 0, "
                        "refused 1")
    assert lines[1] == "paired: P0 TTFT p99 without faults 100 ms, with faults 300 ms, ratio 3.00x"
    assert compare_lines(Tally(), Tally())[1].endswith("ratio -")


def test_the_halves_of_the_run_without_faults_are_counted_as_one() -> None:
    a, b = Tally(sent=3, completed=2), Tally(sent=4, completed=4, resumed=1)
    a.lost["cut"] += 1
    a.ttft["P0"] = [0.1]
    b.ttft["P0"] = [0.3]
    b.ttft["P2"] = [0.5]
    b.counters["migrations"] += 2
    both = merged(a, b)
    assert (both.sent, both.completed, both.resumed, sum(both.lost.values())) == (7, 6, 1, 1)
    assert dict(both.ttft) == {"P0": [0.1, 0.3], "P2": [0.5]} and both.counters["migrations"] == 2


class _FakeMesh:
    """What the fault code asks of a Mesh: names, kill, restart, in_rotation."""

    def __init__(self, names: list[str], back_after: int = 2) -> None:
        self.names = names
        self.calls: list[str] = []
        self.back_after = back_after
        self._looks = 0
        self.config = SimpleNamespace(engines=SimpleNamespace(backend="sim"))

    def kill(self, name: str) -> None:
        self.calls.append(f"kill {name}")
        self._looks = 0

    def restart(self, name: str) -> None:
        self.calls.append(f"restart {name}")

    def in_rotation(self, name: str) -> bool:
        self._looks += 1
        return self._looks > self.back_after

    def rolling_restart(self, role: Role) -> list[Any]:
        self.calls.append(f"roll {role.value}")
        return [SimpleNamespace(name=n, exit_code=0, seconds=1.0) for n in schedulers.replicas(_as_mesh(self))]

    def exited(self) -> list[Any]:
        return []


def _as_mesh(fake: _FakeMesh) -> Mesh:
    return cast(Mesh, fake)


REPLICAS = ["scheduler", "engine-0", "engine-1", "scheduler-1", "scheduler-2", "gateway-0"]


def test_each_kill_draws_a_replica_from_the_seed_and_waits_for_its_engines(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(time, "sleep", lambda s: None)
    mesh = _FakeMesh(REPLICAS)
    assert schedulers.replicas(_as_mesh(mesh)) == ["scheduler", "scheduler-1", "scheduler-2"]
    said = [schedulers.kill_replica(_as_mesh(mesh), random.Random(s)) for s in range(12)]
    killed = [c.split()[1] for c in mesh.calls if c.startswith("kill")]
    assert killed == [random.Random(s).choice(["scheduler", "scheduler-1", "scheduler-2"]) for s in range(12)]
    assert len(set(killed)) == 3
    assert mesh.calls[:2] == [f"kill {killed[0]}", f"restart {killed[0]}"]
    assert "every engine reporting to it" in said[0]
    # One scheduler: nothing drawn, so a seed's later draws are as before replicas.
    one = _FakeMesh(["scheduler", "engine-0"])
    rng = random.Random(5)
    schedulers.kill_replica(_as_mesh(one), rng)
    expected = random.Random(5)
    expected.uniform(0.0, 1.0)
    assert rng.random() == expected.random()


def test_a_replica_whose_engines_never_come_back_fails_the_fault(monkeypatch: pytest.MonkeyPatch) -> None:
    mesh = _FakeMesh(REPLICAS, back_after=10**9)
    with pytest.raises(MeshError, match="not every engine reported"):
        schedulers.wait_in_rotation(_as_mesh(mesh), "scheduler-1", timeout=0.3)


def test_faults_come_every_n_seconds_from_half_of_it(monkeypatch: pytest.MonkeyPatch) -> None:
    mesh = _FakeMesh(REPLICAS)
    chaos = Chaos(_as_mesh(mesh), random.Random(1), ["scheduler-roll"], 1.0, Tally(), every=0.2)
    start = time.monotonic()
    at: list[float] = []

    def roll() -> str:
        at.append(time.monotonic() - start)
        return "rolled"
    chaos.run_fault["scheduler-roll"] = roll
    chaos.run(start + 3.9)                     # faults stop 3 s before the end: due 0.1, 0.3, 0.5, 0.7
    assert len(at) == 4 and len(chaos.tally.actions) == 4
    assert all(a >= 0.1 + 0.2 * i for i, a in enumerate(at)), at


def test_the_replica_roll_fault_rolls_every_scheduler() -> None:
    mesh = _FakeMesh(REPLICAS)
    said = schedulers.roll_replicas(_as_mesh(mesh))
    assert mesh.calls == ["roll scheduler"]
    assert said == "rolled scheduler (exit 0, 1.0s), scheduler-1 (exit 0, 1.0s), scheduler-2 (exit 0, 1.0s)"


@pytest.mark.parametrize(("args", "problem"), [
    (["--faults", "scheduler-roll"], "scheduler-roll needs --schedulers 2"),
    (["--schedulers", "0"], "--schedulers must be"),
    (["--every", "0.5"], "--every must be"),
    (["--priority-mix", "1,2"], "--priority-mix takes three"),
    (["--priority-mix", "a,b,c"], "--priority-mix takes three"),
    (["--netns", "--paired"], "loopback options"),
])
def test_chaos_options_are_checked(args: list[str], problem: str, monkeypatch: pytest.MonkeyPatch,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    chaos = load_script("chaos")
    monkeypatch.setattr(sys, "argv", ["chaos.py", *args])
    with pytest.raises(SystemExit):
        chaos.main()
    assert problem in capsys.readouterr().err
