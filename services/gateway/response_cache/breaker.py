"""A circuit breaker for the shared store: after `failures` failures in a row
it opens, and the cache does not ask the store at all (each request a miss
at no cost) for `reset_seconds`; then ONE call is let through (half-open):
its success closes the breaker, its failure opens it again.

Why: a dead or blackholed Redis would otherwise add its timeout to every
request. Pure logic on an injected clock; the event loop's thread owns it.
"""

from __future__ import annotations

from services.common.clock import Clock

__all__ = ["Breaker"]


class Breaker:
    def __init__(self, failures: int, reset_seconds: float, clock: Clock) -> None:
        self._limit = failures
        self._reset = reset_seconds
        self._clock = clock
        self._failures = 0
        self._opened_at: float | None = None
        self._probing = False

    @property
    def open(self) -> bool:
        return self._opened_at is not None

    def allow(self) -> bool:
        """May a call go to the store now? In the half-open state only one."""
        if self._opened_at is None:
            return True
        if self._probing or self._clock.monotonic() - self._opened_at < self._reset:
            return False
        self._probing = True
        return True

    def success(self) -> None:
        self._failures = 0
        self._opened_at = None
        self._probing = False

    def failure(self) -> None:
        self._failures += 1
        if self._probing or self._failures >= self._limit:
            self._opened_at = self._clock.monotonic()
        self._probing = False
