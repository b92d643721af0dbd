"""`kvmesh up --autoscale MIN:MAX`: the local actuator of the scheduler's
scaling policy. It follows the desired engine count the scheduler publishes
(GetState's `scaling`, the same figure as `kvmesh_scheduler_desired_engines`)
by starting and draining engine processes of this mesh, clamped to
[MIN, MAX], one step per interval (`scheduler.scaling.interval_seconds`).

- Out: the lowest-numbered engine not running starts (its own id and
  ports, planned for MAX engines up front); it counts as active at once, so
  the next step does not start another for the same shortfall. An engine
  being drained is taken back instead (undrained) when the count rises again:
  cheaper than a cold start.
- In: an engine still starting is stopped first (it serves nothing yet);
  else the highest-numbered engine that serves is drained -- the scheduler
  places nothing new on it (Admin DrainEngine) and its running requests
  finish -- then stopped (SIGTERM: the engine's own drain hands over what is
  still running after `drain_seconds`, and the gateways continue those
  streams on other engines from the next token, so none is cut), then
  undrained at the scheduler so a later start of that id takes work.

Every step is a line on the launcher's stderr ("kvmesh: autoscale: ...").
Talks to the first scheduler replica only. Driven from the supervision
loop's one thread (`check` once per pass); the clock is injected for tests.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, TextIO

import grpc

from services.common.clock import Clock, SystemClock
from services.common.config import MeshConfig
from services.common.mesh_tls import MeshIdentity, identity_for, sync_channel
from services.common.proto.kvmesh.v1 import admin_pb2, admin_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from services.launcher.children import ChildSpec, MeshError

__all__ = ["AutoscaleTarget", "EngineFigures", "LocalAutoscaler", "SchedulerLink", "SchedulerView", "parse_bounds"]

# A drained engine's running requests get this long to finish before it is
# stopped (its stop then hands the rest over: migrated, not lost).
DRAIN_SECONDS = 30.0
_RPC_TIMEOUT_SECONDS = 2.0


def parse_bounds(text: str) -> tuple[int, int]:
    """"1:4" -> (1, 4); 0 <= MIN <= MAX, MAX >= 1."""
    lo_text, sep, hi_text = text.partition(":")
    try:
        lo, hi = int(lo_text), int(hi_text)
    except ValueError:
        lo = hi = -1
    if not sep or lo < 0 or hi < max(1, lo):
        raise ValueError(f"--autoscale: {text!r} is not MIN:MAX with 0 <= MIN <= MAX and MAX >= 1")
    return lo, hi


class AutoscaleTarget(Protocol):
    """What the actuator needs of the mesh (services/launcher/mesh.py)."""

    def is_running(self, name: str) -> bool: ...
    def launch(self, spec: ChildSpec) -> None: ...
    def started(self, name: str) -> bool: ...
    def terminate(self, name: str) -> None: ...


@dataclass(frozen=True)
class EngineFigures:
    leases: int
    running: int


class SchedulerLink(Protocol):
    """What the actuator asks the scheduler (`SchedulerView`)."""

    def read(self) -> tuple[int | None, str, dict[str, EngineFigures]]: ...
    def drain(self, engine_id: str, on: bool) -> None: ...
    def close(self) -> None: ...


@dataclass
class SchedulerView:
    """GetState and the Admin calls the actuator makes, over one channel."""

    address: str
    identity: MeshIdentity | None
    admin_token: str
    model: str
    _channel: grpc.Channel | None = None

    def _stubs(self) -> tuple[scheduler_pb2_grpc.SchedulerStub, admin_pb2_grpc.AdminStub]:
        if self._channel is None:
            self._channel = sync_channel(self.address, self.identity, "scheduler")
        return scheduler_pb2_grpc.SchedulerStub(self._channel), admin_pb2_grpc.AdminStub(self._channel)

    def read(self) -> tuple[int | None, str, dict[str, EngineFigures]]:
        """(desired for the model or None, its reason, engine id -> figures)."""
        state = self._stubs()[0].GetState(scheduler_pb2.GetStateRequest(), timeout=_RPC_TIMEOUT_SECONDS)
        engines = {e.engine_id: EngineFigures(e.leases, e.running) for e in state.engines}
        for m in state.scaling:
            if m.model == self.model:
                return m.desired, m.reason, engines
        return None, "", engines

    def drain(self, engine_id: str, on: bool) -> None:
        admin = self._stubs()[1]
        metadata = (("authorization", f"Bearer {self.admin_token}"),)
        if on:
            admin.DrainEngine(admin_pb2.DrainEngineRequest(engine_id=engine_id), timeout=_RPC_TIMEOUT_SECONDS,
                              metadata=metadata)
        else:
            admin.UndrainEngine(admin_pb2.UndrainEngineRequest(engine_id=engine_id),
                                timeout=_RPC_TIMEOUT_SECONDS, metadata=metadata)

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None

    @classmethod
    def for_mesh(cls, config: MeshConfig, address: str, admin_token: str) -> SchedulerView:
        return cls(address, identity_for(config, "admin"), admin_token, config.engines.template.model)


@dataclass
class _Engine:
    spec: ChildSpec
    state: str = "idle"          # idle | starting | serving | draining | stopping
    since: float = 0.0


@dataclass
class LocalAutoscaler:
    """Follows the scheduler's desired count with this mesh's engine specs
    (all MAX of them, in index order; the first `len(started)` running)."""

    target: AutoscaleTarget
    view: SchedulerLink
    specs: list[ChildSpec]
    bounds: tuple[int, int]
    interval: float
    clock: Clock = field(default_factory=SystemClock)
    out: TextIO | None = None
    drain_seconds: float = DRAIN_SECONDS
    _engines: list[_Engine] = field(default_factory=list)
    _next: float = 0.0
    steps: list[str] = field(default_factory=list)   # what it did, in order (tests, logs)

    def __post_init__(self) -> None:
        self._engines = [_Engine(s, "serving" if self.target.is_running(s.name) else "idle") for s in self.specs]
        self._next = self.clock.monotonic() + self.interval

    def _say(self, text: str) -> None:
        self.steps.append(text)
        print(f"kvmesh: autoscale: {text}", file=self.out or sys.stderr, flush=True)

    def close(self) -> None:
        self.view.close()

    def active(self) -> int:
        """Engines counted towards the desired number: serving or starting."""
        return sum(e.state in ("starting", "serving") for e in self._engines)

    def check(self) -> None:
        """One supervision pass: progress starts and drains; every interval, one step."""
        now = self.clock.monotonic()
        figures: dict[str, EngineFigures] = {}
        desired: int | None = None
        reason = ""
        try:
            desired, reason, figures = self.view.read()
        except grpc.RpcError as exc:
            if now >= self._next:
                self._say(f"cannot read the scheduler's state ({exc.code().name}); no step this interval")
                self._next = now + self.interval
            return
        self._progress(figures, now)
        if now >= self._next and desired is not None:
            self._next = now + self.interval
            self._step(desired, reason, now)

    def _progress(self, figures: dict[str, EngineFigures], now: float) -> None:
        for e in self._engines:
            name = e.spec.name
            if e.state == "starting":
                self._look(e, now)
            elif e.state == "draining":
                f = figures.get(name)
                if f is None or (f.leases == 0 and f.running == 0) or now - e.since >= self.drain_seconds:
                    left = "" if f is None else f" ({f.leases} leases, {f.running} running)"
                    self._say(f"stopping {name} after {now - e.since:.1f} s of drain{left}")
                    self.target.terminate(name)
                    e.state = "stopping"
            elif e.state == "stopping" and not self.target.is_running(name):
                self._undrain(name)
                self._say(f"{name} left after {now - e.since:.1f} s")
                e.state = "idle"

    def _look(self, e: _Engine, now: float) -> None:
        try:
            healthy = self.target.started(e.spec.name)
        except MeshError as exc:
            self._say(f"{e.spec.name} failed to start: {str(exc).splitlines()[0]}")
            e.state = "idle"
            return
        if healthy:
            self._say(f"{e.spec.name} serving after {now - e.since:.1f} s")
            e.state = "serving"

    def _step(self, desired: int, reason: str, now: float) -> None:
        lo, hi = self.bounds
        want, have = min(hi, max(lo, desired)), self.active()
        if want > have:
            self._out(want, have, reason, now)
        elif want < have:
            self._in(want, have, reason, now)

    def _out(self, want: int, have: int, reason: str, now: float) -> None:
        back = next((e for e in self._engines if e.state == "draining"), None)
        if back is not None:
            self._undrain(back.spec.name)
            back.state = "serving"
            self._say(f"desired {want}, active {have} ({reason}): {back.spec.name} taken back from its drain")
            return
        idle = next((e for e in self._engines if e.state == "idle" and not self.target.is_running(e.spec.name)),
                    None)
        if idle is None:
            return
        self._say(f"desired {want}, active {have} ({reason}): starting {idle.spec.name}")
        try:
            self.target.launch(idle.spec)
        except MeshError as exc:
            self._say(f"could not start {idle.spec.name}: {exc}")
            return
        idle.state, idle.since = "starting", now

    def _in(self, want: int, have: int, reason: str, now: float) -> None:
        starting = [e for e in self._engines if e.state == "starting"]
        if starting:   # nothing runs there yet: stopped at once, and a serving engine keeps serving
            victim = starting[-1]
            self._say(f"desired {want}, active {have} ({reason}): {victim.spec.name} stopped while starting")
            self.target.terminate(victim.spec.name)
            victim.state, victim.since = "stopping", now
            return
        serving = [e for e in self._engines if e.state == "serving"]
        if not serving:
            return
        victim = serving[-1]
        self._say(f"desired {want}, active {have} ({reason}): draining {victim.spec.name}")
        if not self._quietly(lambda: self.view.drain(victim.spec.name, True)):
            return
        victim.state, victim.since = "draining", now

    def _undrain(self, name: str) -> None:
        """A later start of this id takes work again (the scheduler keeps an
        admin drain across reconnects)."""
        self._quietly(lambda: self.view.drain(name, False))

    def _quietly(self, call: Callable[[], None]) -> bool:
        try:
            call()
        except grpc.RpcError as exc:
            self._say(f"admin call failed: {exc.code().name} {exc.details()}")
            return False
        return True
