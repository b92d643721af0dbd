"""`kvmesh up`'s restarts: the scheduler, the engines and the gateways are
restarted (soft state; an engine exits by itself when its backend died or
hung), never twice for one exit (a rolling restart's start counts), each child
on its own schedule (one slow start holds up no other restart), a failed
restart is tried again with backoff, and at most `max_attempts` restarts
of a child happen in any window. Over a fake supervisor and a fake clock."""

from __future__ import annotations

import io
import random
import subprocess
import threading
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import pytest

from services.launcher.children import ChildExit, MeshError
from services.launcher.mesh import Mesh, MeshOptions, RestartPolicy, Role
from services.launcher.restarts import RestartRules, Restarts

ROOT = Path(__file__).resolve().parents[3]


@dataclass
class FakeSupervisor:
    """Children by name; a test says who exits and how each start goes. Also
    the clock (`now`, moved by the test)."""

    policies: dict[str, RestartPolicy]
    now: float = 1000.0
    pending: list[ChildExit] = field(default_factory=list)
    # name -> what `started` answers on each look while it starts:
    # False (starting), True (healthy) or "exit" (exited before healthy).
    looks: dict[str, list[bool | str]] = field(default_factory=dict)
    spawn_fails: dict[str, int] = field(default_factory=dict)  # name -> failures left
    respawns: list[tuple[str, float]] = field(default_factory=list)
    starting: set[str] = field(default_factory=set)
    pids: dict[str, int] = field(default_factory=dict)  # name -> its current process (4242 first)

    def monotonic(self) -> float:
        return self.now

    def wall(self) -> float:
        return self.now

    def pid(self, name: str) -> int | None:
        return self.pids.get(name, 4242)

    def die(self, name: str, code: int = 3) -> None:
        self.starting.discard(name)
        self.pending.append(ChildExit(name, self.pid(name) or 0, code, Path(f"/logs/{name}.log")))

    def start_elsewhere(self, name: str) -> None:
        """Another hand (a rolling restart) starts it again and waits until healthy."""
        self.pids[name] = (self.pid(name) or 0) + 1

    def exited(self) -> list[ChildExit]:
        out, self.pending = self.pending, []
        return out

    def restart_policy(self, name: str) -> RestartPolicy:
        return self.policies[name]

    def respawn(self, name: str) -> None:
        self.respawns.append((name, self.now))
        if self.spawn_fails.get(name, 0):
            self.spawn_fails[name] -= 1
            raise MeshError(f"could not start {name}: no such file")
        self.pids[name] = (self.pid(name) or 0) + 1
        self.starting.add(name)

    def started(self, name: str) -> bool:
        if name not in self.starting:
            return True
        looks = self.looks.get(name) or [True]
        look = looks.pop(0) if len(looks) > 1 else looks[0]
        if look == "exit":
            self.starting.discard(name)
            raise MeshError(f"{name} exited with code 1 before it became healthy")
        if look is True:
            self.starting.discard(name)
        return bool(look)


def _setup(rules: RestartRules | None = None) -> tuple[FakeSupervisor, Restarts]:
    fake = FakeSupervisor({"scheduler": RestartPolicy.ALWAYS, "engine-0": RestartPolicy.ALWAYS,
                           "engine-1": RestartPolicy.ALWAYS, "gateway-0": RestartPolicy.ALWAYS,
                           "envoy": RestartPolicy.NEVER})
    return fake, Restarts(fake, rules, clock=fake, out=io.StringIO())


def _run(fake: FakeSupervisor, restarts: Restarts, until: float, step: float = 0.5) -> None:
    """The supervision loop's passes, every `step` s of fake time."""
    while fake.now < until:
        restarts.check()
        fake.now += step


def test_a_dead_child_is_restarted_at_once_and_reported_healthy() -> None:
    fake, restarts = _setup()
    fake.looks["engine-0"] = [False, False, True]
    fake.die("engine-0")
    restarts.check()
    assert fake.respawns == [("engine-0", 1000.0)] and [e.name for e in restarts.exits] == ["engine-0"]
    assert restarts.restarted == []  # starting: not healthy yet
    _run(fake, restarts, 1002.0)
    assert restarts.restarted == ["engine-0"] and len(fake.respawns) == 1


def test_a_slow_start_holds_up_no_other_restart() -> None:
    """engine-0 takes minutes to start; engine-1 and the scheduler dying
    meanwhile are restarted at once, and healthy long before it."""
    fake, restarts = _setup()
    fake.looks["engine-0"] = [False]  # starting, for as long as we look
    fake.die("engine-0")
    restarts.check()
    fake.now += 5
    fake.die("engine-1")
    fake.die("scheduler")
    restarts.check()
    assert [name for name, _ in fake.respawns] == ["engine-0", "engine-1", "scheduler"]
    assert {t for _, t in fake.respawns[1:]} == {1005.0}
    fake.now += 0.5
    restarts.check()
    assert sorted(restarts.restarted) == ["engine-1", "scheduler"]
    fake.looks["engine-0"] = [True]
    restarts.check()
    assert restarts.restarted[-1] == "engine-0"


def test_a_failed_restart_is_tried_again_with_backoff() -> None:
    """The restarted child exits before it is healthy, again and again:
    the next attempt 1, 2, 4 s after each failure is seen (one pass, 0.5 s,
    after the attempt); the next start that succeeds ends it."""
    fake, restarts = _setup()
    fake.looks["engine-0"] = ["exit", "exit", "exit", False, True]
    fake.die("engine-0")
    _run(fake, restarts, 1020.0)
    times = [t - 1000.0 for name, t in fake.respawns if name == "engine-0"]
    assert times == [0.0, 1.5, 4.0, 8.5], times
    assert restarts.failed == ["engine-0"] * 3 and restarts.restarted == ["engine-0"]


def test_a_restart_that_cannot_spawn_is_tried_again() -> None:
    fake, restarts = _setup()
    fake.spawn_fails["scheduler"] = 2
    fake.die("scheduler")
    _run(fake, restarts, 1010.0)
    assert [t - 1000.0 for _, t in fake.respawns] == [0.0, 1.0, 3.0]
    assert restarts.restarted == ["scheduler"] and restarts.failed == ["scheduler", "scheduler"]


def test_an_exit_also_seen_as_a_failed_start_is_one_failure() -> None:
    """A child dying while it starts: its look says so, and the supervisor
    reports the exit too (in the next pass): one retry, not two."""
    fake, restarts = _setup()
    fake.die("engine-0")
    restarts.check()  # respawned
    fake.looks["engine-0"] = ["exit", True]
    fake.now += 0.5
    restarts.check()  # the look: exited before healthy -> retry in 1 s
    fake.pending.append(ChildExit("engine-0", 4243, 1, Path("/logs/engine-0.log")))
    fake.now += 0.5
    restarts.check()  # the same exit, reported
    _run(fake, restarts, 1010.0)
    assert [t - 1000.0 for _, t in fake.respawns] == [0.0, 1.5]
    assert restarts.restarted == ["engine-0"] and restarts.failed == ["engine-0"]


def test_backoff_grows_on_a_crash_loop_and_resets_after_a_stable_run() -> None:
    fake, restarts = _setup(RestartRules(max_attempts=100))
    fake.die("engine-0")
    _run(fake, restarts, 1001.0)                 # restarted at once, healthy
    delays = []
    for _ in range(7):                           # dies 2 s after each healthy start
        fake.now += 2
        fake.die("engine-0")
        restarts.check()
        due = restarts.due("engine-0")
        assert due is not None
        delays.append(due - fake.now)
        _run(fake, restarts, due + 1)
    assert delays == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]
    fake.now += restarts.rules.stable_seconds    # then it runs for a minute
    fake.die("engine-0")
    restarts.check()
    assert fake.respawns[-1] == ("engine-0", fake.now)  # at once again


def test_at_most_max_attempts_restarts_in_a_window_then_it_waits_never_gives_up() -> None:
    rules = RestartRules(backoff_first=1.0, backoff_max=1.0, max_attempts=3, window_seconds=100.0)
    fake, restarts = _setup(rules)
    fake.looks["engine-1"] = ["exit"]  # every start fails
    fake.die("engine-1")
    _run(fake, restarts, 1250.0)
    times = [t - 1000.0 for _, t in fake.respawns]
    assert times[:3] == [0.0, 1.5, 3.0]
    assert times[3] == 100.0  # the 4th waits until the first leaves the window
    for i in range(len(times)):  # never more than 3 in any 100 s
        assert sum(1 for t in times if times[i] <= t < times[i] + 100.0) <= 3
    assert len(times) >= 6  # and it keeps trying


def test_a_child_without_restart_policy_is_only_reported() -> None:
    fake, restarts = _setup()
    fake.die("envoy", code=-9)
    _run(fake, restarts, 1010.0)
    assert fake.respawns == [] and [(e.name, e.returncode) for e in restarts.exits] == [("envoy", -9)]


def test_a_dead_gateway_is_restarted_like_the_others() -> None:
    fake, restarts = _setup()
    fake.looks["gateway-0"] = [False, True]
    fake.die("gateway-0", code=-9)
    restarts.check()
    assert fake.respawns == [("gateway-0", 1000.0)]
    _run(fake, restarts, 1002.0)
    assert restarts.restarted == ["gateway-0"] and len(fake.respawns) == 1


def test_a_child_started_again_by_a_rolling_restart_is_not_started_twice() -> None:
    """gateway-0 died soon after a restart (its next one backs off 1 s); a
    rolling restart starts it meanwhile and waits for its health: the due
    restart is dropped -- respawning would stop the fresh process and cut
    what it carries. A later exit of that process is restarted again."""
    fake, restarts = _setup()
    fake.die("gateway-0")
    _run(fake, restarts, 1001.0)                 # restarted at once, healthy
    fake.die("gateway-0")                        # dies again within stable_seconds
    restarts.check()
    assert restarts.due("gateway-0") == fake.now + 1.0
    fake.start_elsewhere("gateway-0")            # SIGUSR1's roll, before the backoff ran out
    _run(fake, restarts, fake.now + 5.0)
    assert fake.respawns == [("gateway-0", 1000.0)] and restarts.due("gateway-0") is None
    fake.now += restarts.rules.stable_seconds
    fake.die("gateway-0")
    restarts.check()
    assert fake.respawns[-1] == ("gateway-0", fake.now)  # the rolled process ran long enough: at once


def test_scheduler_engines_and_gateways_restart_always_envoy_never(tmp_path: Path) -> None:
    from services.common.config import load_config

    if not (ROOT / ".models" / "tiny-llama").is_dir():
        pytest.skip(".models/tiny-llama is missing: run `make setup`")
    config = load_config(ROOT / "config" / "kvmesh.yaml")
    mesh = Mesh(config, MeshOptions(engines=1, model="tiny-llama", envoy=False, free_ports=True, run_dir=tmp_path))
    policies = {spec.role: spec.restart for spec in mesh.specs()}
    assert policies[Role.SCHEDULER] is RestartPolicy.ALWAYS
    assert policies[Role.ENGINE] is RestartPolicy.ALWAYS
    assert policies[Role.GATEWAY] is RestartPolicy.ALWAYS


class _ChaosMesh(FakeSupervisor):
    """What scripts/chaos.py's fault loop reads of a mesh, beside the supervisor."""

    names = ("scheduler", "engine-0", "engine-1", "gateway-0")
    config = SimpleNamespace(engines=SimpleNamespace(backend="vllm"))


def test_the_chaos_loop_restarts_an_engine_that_exits_on_its_own() -> None:
    # A vLLM engine whose core chaos.py killed exits 3 by itself; the loop's
    # Restarts must schedule it as `kvmesh up` does (it was built with a stale
    # argument once, and the first such exit crashed the fault thread).
    from scripts.chaoslib.loopback import Chaos
    from scripts.chaoslib.outcomes import Tally

    mesh = _ChaosMesh({"scheduler": RestartPolicy.ALWAYS, "engine-0": RestartPolicy.ALWAYS,
                       "engine-1": RestartPolicy.ALWAYS, "gateway-0": RestartPolicy.NEVER})
    chaos = Chaos(mesh, random.Random(1), ["core-kill", "hang"], 1.0, Tally())  # type: ignore[arg-type]  # a fake mesh: only what Chaos reads
    mesh.die("engine-0")
    chaos.restarts.check()
    assert [e.name for e in chaos.restarts.exits] == ["engine-0"]
    assert [name for name, _ in mesh.respawns] == ["engine-0"]  # it had run long enough: at once


def test_the_chaos_hang_fault_survives_a_stopped_process_that_was_ended() -> None:
    # A vLLM engine ends its core once it declares it hung (the bound is
    # shorter than a long `--hang-seconds`); SIGCONT then found no process and
    # the fault thread died with ProcessLookupError, ending the run unreported.
    from scripts.chaoslib.loopback import Chaos
    from scripts.chaoslib.outcomes import Tally

    victim = subprocess.Popen(["sleep", "30"])
    mesh = _ChaosMesh({"engine-0": RestartPolicy.ALWAYS, "engine-1": RestartPolicy.ALWAYS})
    mesh.config = SimpleNamespace(engines=SimpleNamespace(backend="sim"))
    mesh.pid = lambda _name: victim.pid  # type: ignore[method-assign, assignment]  # the fake mesh's pid, set per test
    chaos = Chaos(mesh, random.Random(1), ["hang"], 0.5, Tally())  # type: ignore[arg-type]  # a fake mesh: only what Chaos reads
    # As the engine ends its hung core, and its parent reaps it.
    ender = threading.Timer(0.1, lambda: (victim.kill(), victim.wait(10)))  # type: ignore[func-returns-value]  # a lambda making two calls; the timer drops the tuple
    ender.start()
    try:
        said = chaos.hang()
    finally:
        ender.cancel()
        victim.kill()
        victim.wait(10)
    assert "gone by then" in said
