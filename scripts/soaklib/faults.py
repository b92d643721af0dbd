"""The soak's faults: one every `every` seconds (a seeded draw), made by the
chaos run's own fault code (scripts/chaoslib/loopback.py `Chaos`), from a
plan that leaves every kind of service one long life to measure.

Each half of the run has its kinds, drawn from a shuffled deck (every kind
comes round before any repeats) and its victims:

- first half: engine-kill (engine-1), scheduler-kill, gateway-kill
  (gateway-1), hang (either engine: a stopped process lives on), gateway-roll
  (both gateways);
- second half: engine-kill (engine-0), gateway-kill (gateway-1), batch-kill,
  hang (either engine).

So engine-0 and the batch service live through the first half, the
scheduler, gateway-0 (rolled last in the first half) and engine-1 through
the second, Envoy and Redis through all of it: each kind of service has a
series long enough to fit after its warm-up (series.py). Between faults the
loop does what `kvmesh up` does for a child that exits on its own
(`Restarts`), once a second.

Not made: `partition` (the loopback mesh has no links to cut: partitions
need the namespace hosts of `chaos.py --netns`, as root) and `core-kill`
(vLLM only)."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable

from scripts.chaoslib.loopback import Chaos

__all__ = ["HALVES", "FaultPlan", "SoakFaults"]

# (kind, victim or None for the fault's own pick), per half of the run.
HALVES: tuple[tuple[tuple[str, str | None], ...], ...] = (
    (("engine-kill", "engine-1"), ("scheduler-kill", None), ("gateway-kill", "gateway-1"), ("hang", None),
     ("gateway-roll", None)),
    (("engine-kill", "engine-0"), ("gateway-kill", "gateway-1"), ("batch-kill", None), ("hang", None)),
)
# No fault in the run's last seconds: what it broke has time to heal.
QUIET_END_SECONDS = 30.0


class FaultPlan:
    """Which fault comes next, and when."""

    def __init__(self, rng: random.Random, duration: float, every: tuple[float, float]) -> None:
        self.rng, self.duration, self.every = rng, duration, every
        self._decks: list[list[tuple[str, str | None]]] = [[], []]

    def gap(self) -> float:
        return self.rng.uniform(*self.every)

    def pick(self, elapsed: float) -> tuple[str, str | None]:
        half = 0 if elapsed < self.duration / 2 else 1
        deck = self._decks[half]
        if not deck:
            deck.extend(HALVES[half])
            self.rng.shuffle(deck)
        return deck.pop()


class SoakFaults:
    """The fault loop, on a thread of its own (the mesh is driven from one
    thread); `stop` ends it."""

    def __init__(self, chaos: Chaos, plan: FaultPlan) -> None:
        self.chaos, self.plan = chaos, plan
        self.stop = threading.Event()
        self.made: list[str] = []   # kinds, in order
        self.failed = ""
        self.run_fault: dict[str, Callable[[str | None], str]] = {
            "engine-kill": chaos.engine_kill, "scheduler-kill": lambda _: chaos.scheduler_kill(),
            "gateway-kill": chaos.gateway_kill, "hang": chaos.hang,
            "gateway-roll": lambda _: chaos.gateway_roll(), "batch-kill": lambda _: chaos.batch_kill(),
        }

    def run(self, began: float, until: float) -> None:
        try:
            self._loop(began, until)
        except Exception as exc:  # noqa: BLE001 - the load goes on; the report shows it
            self.failed = f"{type(exc).__name__}: {exc}"
            self.chaos.tally.actions.append(f"fault loop stopped: {self.failed}")

    def _loop(self, began: float, until: float) -> None:
        next_at = began + self.plan.gap()
        while not self.stop.wait(1.0):
            self.chaos.restarts.check()
            now = time.monotonic()
            if now < next_at or now > until - QUIET_END_SECONDS:
                continue
            kind, victim = self.plan.pick(now - began)
            what = self.run_fault[kind](victim)
            self.made.append(kind)
            self.chaos.tally.actions.append(f"{now - began:6.1f}s {kind}: {what} (+{time.monotonic() - now:.1f}s)")
            self.chaos.restarts.check()
            next_at = time.monotonic() + self.plan.gap()
