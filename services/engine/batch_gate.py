"""Which live generations the backend has now: every P0 at once, the other
classes up to the engine's advertised `max_running` (the p0_headroom rule).

The backend's batch is `max_running + p0_headroom` (BackendInfo says both).
A request of priority > 0 is handed to the backend only while fewer than
`max_running` non-P0 requests are in it (running or in its own queue); the
rest wait here in the order they arrived -- the order the scheduler placed
them in, which already weighed their classes and their aging -- and go in
the moment one of those leaves, event-driven (the generation's pump ending),
never polled. Not by class here: a P2 the scheduler placed before a stream
of P1 requests would wait behind every one of them, beyond the reach of the
scheduler's aging (a lease is not queued there), and could time out.
So at least `p0_headroom` running slots are always free of batch work,
and a P0 joins the running batch at the backend's next step. P0
requests beyond the headroom wait in the backend's own queue, first in line
(its priority order).

Removal of a held request (cancel, abort, hand-over) is O(1): the entry
leaves `_held`, an insertion-ordered dict that is also the queue.

Ownership: owned by one EngineRuntime; every method runs on the event loop
thread and none awaits.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

from services.engine.backend import GenerationRequest
from services.engine.metrics import EngineMetrics

__all__ = ["BatchGate", "Gated"]


class Gated(Protocol):
    """What the gate holds: a live generation that can start in the backend."""

    request: GenerationRequest

    def submit(self) -> None:
        """Start it in the backend now (the gate counts it from here until
        `BatchGate.left`)."""


G = TypeVar("G", bound=Gated)


class BatchGate(Generic[G]):
    def __init__(self, max_running: Callable[[], int], metrics: EngineMetrics) -> None:
        # Read at each decision: vLLM resolves its limits only when it starts.
        self._max_running = max_running
        self._metrics = metrics
        self._held: dict[str, G] = {}   # arrival order: the queue
        self._held_tokens = 0
        self._others = 0  # non-P0 requests in the backend
        self._p0 = 0      # P0 requests in the backend

    # ---------------------------------------------------------------- views

    @property
    def in_backend(self) -> int:
        """Requests handed to the backend and not yet let go."""
        return self._others + self._p0

    @property
    def held(self) -> list[G]:
        """Requests waiting here, in arrival order."""
        return list(self._held.values())

    @property
    def held_ids(self) -> list[str]:
        return list(self._held)

    @property
    def held_tokens(self) -> int:
        """Prompt tokens of the held requests (none is prefilled yet)."""
        return self._held_tokens

    # ---------------------------------------------------------------- changes

    def offer(self, gen: G) -> None:
        """A generation that wants to start: into the backend now, or held."""
        limit = self._max_running()
        if gen.request.priority == 0:
            if self.in_backend >= limit:
                self._metrics.p0_over_admitted()
            self._p0 += 1
            gen.submit()
        elif self._others < limit:  # (nothing is held while there is room)
            self._others += 1
            gen.submit()
        else:
            self._held[gen.request.request_id] = gen
            self._held_tokens += len(gen.request.prompt_token_ids)
        self._report(limit)

    def withdraw(self, gen: G) -> bool:
        """Forget a held generation (cancelled or handed over before it
        started); False if it is not held here."""
        request_id = gen.request.request_id
        if self._held.get(request_id) is not gen:
            return False
        del self._held[request_id]
        self._held_tokens -= len(gen.request.prompt_token_ids)
        self._report(self._max_running())
        return True

    def left(self, gen: G) -> None:
        """A submitted generation's backend stream is closed: its slot is
        free, so the first held request (if any) goes in."""
        if gen.request.priority == 0:
            self._p0 -= 1
        else:
            self._others -= 1
        limit = self._max_running()
        while self._others < limit and self._held:
            request_id = next(iter(self._held))
            held = self._held.pop(request_id)
            self._held_tokens -= len(held.request.prompt_token_ids)
            self._others += 1
            held.submit()
        self._report(limit)

    def _report(self, limit: int) -> None:
        self._metrics.batch_gate(held=len(self._held), over_max_running=max(0, self.in_backend - limit))
