"""Admission control: per-class queue caps, per-tenant caps, TTLs, and the
retry-after a rejected client is given.

Retry-after follows Little's law, W = L / lambda: the requests ahead of a new
one (L) divided by the recent dispatch rate (lambda, placements per second
over a sliding window), clamped to [retry_after_min, retry_after_max]. With
no dispatch in the window nothing is moving, and the maximum is given.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from services.common.config import SchedulerConfig

from .classes import ClassRules, ClassTable, class_problems
from .records import AdmissionError, AdmitOptions, RejectReason

__all__ = ["AdmissionLimits", "DispatchRateMeter", "validate_options"]


class DispatchRateMeter:
    """Placements per second over the last `window` seconds. O(1) amortised
    per event; memory is bounded by the events inside the window."""

    def __init__(self, window: float) -> None:
        self._window = window
        self._events: deque[float] = deque()
        self._started: float | None = None

    def record(self, now: float) -> None:
        if self._started is None:
            self._started = now
        self._events.append(now)
        self._prune(now)

    def _prune(self, now: float) -> None:
        while self._events and self._events[0] <= now - self._window:
            self._events.popleft()

    def rate(self, now: float) -> float:
        """Placements per second; 0.0 when none happened in the window."""
        self._prune(now)
        if not self._events or self._started is None:
            return 0.0
        # Early on, divide by the time observed so far, not the full window.
        span = min(self._window, max(now - self._started, 1.0))
        return len(self._events) / span


@dataclass(frozen=True)
class AdmissionLimits:
    classes: ClassTable        # per-class caps and TTLs (classes.py)
    tenant_cap: int
    retry_min: float
    retry_max: float

    @classmethod
    def from_config(cls, config: SchedulerConfig, classes: ClassTable | None = None) -> AdmissionLimits:
        return cls(
            classes if classes is not None else ClassTable.from_config(config),
            config.tenant_queue_cap,
            config.retry_after_min_seconds,
            config.retry_after_max_seconds,
        )

    def retry_after(self, ahead: int, rate: float) -> float:
        """Little's law estimate of how long `ahead` requests take to leave."""
        if rate <= 0:
            return self.retry_max
        return min(self.retry_max, max(self.retry_min, ahead / rate))

    def check_cap(self, rules: ClassRules, queued: int, rate: float) -> None:
        """Raise AdmissionError when `queued` requests fill the queue cap of
        `rules`' class. Caps are per class, so nothing queued in another
        class can make room here; a class with its own cap (CapScope.OWN)
        counts only there, so it cannot crowd the others out of the queues."""
        if queued >= rules.queue_cap:
            raise AdmissionError(
                RejectReason.QUEUE_FULL,
                f"the {rules.name} queue is full ({rules.queue_cap} {rules.unit}); retry later",
                self.retry_after(queued, rate),
            )

    def tenant_full(self, tenant: str, tenant_len: int, rate: float) -> AdmissionError | None:
        """The error for a tenant at its queued cap (None below it). The
        caller first tries to displace a lower class of the same tenant."""
        if tenant_len < self.tenant_cap:
            return None
        return AdmissionError(
            RejectReason.TENANT_FULL,
            f"tenant {tenant!r} already has {tenant_len} requests queued "
            f"(cap {self.tenant_cap}) and none of a lower class to make room; "
            "wait for some to finish",
            self.retry_after(tenant_len, rate),
        )

    def displaced_error(self, tenant: str, tenant_len: int, by_class: int, rate: float) -> AdmissionError:
        """What a queued request displaced for a higher class is told."""
        return AdmissionError(
            RejectReason.TENANT_FULL,
            f"displaced by a higher-class (P{by_class}) request of the same tenant {tenant!r}, "
            f"which is at its queued cap ({self.tenant_cap}); retry later",
            self.retry_after(tenant_len, rate),
        )

    def expires_at(self, options: AdmitOptions, arrival: float, wall_to_monotonic: float) -> float:
        """TTL is counted from arrival in the class the request was admitted
        in: aging moves it up but does not shorten its patience. A class
        whose TTL is the request's own deadline (a batch's 24 h completion
        window outlives the P2 TTL) takes that when one is set;
        `wall_to_monotonic` = monotonic now - wall now."""
        rules = self.classes[options.klass]
        if rules.ttl_from_deadline and options.batch_deadline_unix > 0:
            return options.batch_deadline_unix + wall_to_monotonic
        return arrival + rules.ttl_seconds


def validate_options(options: AdmitOptions) -> None:
    """Reject malformed admissions with a message that says what to change."""
    problems = []
    if not options.request_id:
        problems.append("request_id is empty")
    if not options.model:
        problems.append("model is empty")
    problems.extend(class_problems(options))
    if options.prompt_tokens <= 0:
        problems.append("prompt_tokens must be > 0")
    if options.arrival_unix < 0:
        problems.append("arrival_unix must be >= 0 (0 = now)")
    if not (math.isfinite(options.batch_deadline_unix) and options.batch_deadline_unix >= 0):
        problems.append("batch_deadline_unix must be a finite time >= 0 (0 = the P2 TTL)")
    if problems:
        raise AdmissionError(RejectReason.INVALID, "invalid admission: " + "; ".join(problems))
