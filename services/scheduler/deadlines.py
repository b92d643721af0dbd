"""The deadline book: timeouts learned from the fleet's live latency.

The scheduler is the one place that sees every gateway's requests, so it
keeps the windows (latency_window.py), per (model, admitted class):

  queue_wait   arrival -> placement (the core observes it at placement; a
               request that expires counts with the bound it waited, so a
               backlog raises the p95 rather than hiding from it);
  first_token  placement -> the gateway's `FirstToken` on that engine;
  token_stall  gaps between a stream's deltas, sampled by the gateway into
               `RequestDone.delta_gaps_seconds`.

Each deadline is clamp(multiple x p95, floor, ceiling) with its `source`
(derived | floor | ceiling), or the ceiling (source "default") while its
window holds fewer than `min_samples`; `generation` is
clamp(multiple x (p95 first token + max_tokens x p95 gap), floor, ceiling)
for one request. Config: `deadlines` (services/common/config/deadlines.py).

Where they act: the core stamps every `PlacedInfo` with the first-token,
stall and generation deadlines (`stamp`; the gateway's driver enforces them,
services/gateway/stall_watch.py) and gives each queued request its queue-wait
bound at admission (`queue_bound`: expiry is 503 `expired`, its message
naming the bound and the p95 it came from).

Ownership: the core owns the book and calls it only from its own thread
(core.py); `refresh_metrics` runs from the core's housekeeping tick.
"""

from __future__ import annotations

import enum
import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from services.common.config import DeadlineBounds, MeshConfig
from services.common.metric_labels import priority_label

from .classes import ClassRules, ClassTable
from .events import Delivery
from .latency_window import LatencyWindow
from .metrics import SchedulerMetrics
from .records import AdmitOptions, PlacedDeadlines, PlacedInfo, QueueEntry, RequestRecord

__all__ = ["Deadline", "DeadlineBook", "DeadlineKind", "PlacedDeadlines", "Source"]


class DeadlineKind(enum.Enum):
    QUEUE_WAIT = "queue_wait"
    FIRST_TOKEN = "first_token"
    TOKEN_STALL = "token_stall"
    GENERATION = "generation"


class Source(enum.Enum):
    DERIVED = "derived"   # multiple x p95, inside the bounds
    FLOOR = "floor"       # multiple x p95 was below the floor
    CEILING = "ceiling"   # multiple x p95 was above the ceiling
    DEFAULT = "default"   # too few samples (or deadlines off): the ceiling


@dataclass(frozen=True)
class Deadline:
    kind: DeadlineKind
    model: str
    priority: int
    seconds: float
    p95: float | None      # the p95 it came from (generation: the estimate), None = no samples
    samples: int
    source: Source

    def describe(self) -> str:
        """For messages: '3 x p95 0.42 s' or why it is not derived."""
        return self._description

    @functools.cached_property
    def _description(self) -> str:
        if self.source is Source.DEFAULT or self.p95 is None:
            return f"the fixed {self.seconds:g} s ({self.samples} samples so far)"
        return (f"{self.seconds:.3g} s, from the p95 {self.p95:.3g} s of {self.samples} recent samples "
                f"({self.source.value})")


# How old a p95 may be when read (latency_window.py): placements ask for it
# at every step of a busy dispatch; a quarter second is fresh enough.
_P95_STALENESS_SECONDS = 0.25

_WINDOWED = (DeadlineKind.QUEUE_WAIT, DeadlineKind.FIRST_TOKEN, DeadlineKind.TOKEN_STALL)


class DeadlineBook:
    def __init__(self, config: MeshConfig, metrics: SchedulerMetrics | None = None,
                 classes: ClassTable | None = None) -> None:
        self._config = config.deadlines
        self._classes = classes if classes is not None else ClassTable.from_config(config.scheduler)
        self._max_generation = config.gateway.max_generation_seconds
        self._hang_floor = config.engines.template.hang_floor_seconds
        # A queued request is never turned away before it could have aged to
        # P0 and then had P0's floor there: each rank's queue-wait floor is
        # the floor + its ClassRules.aging_to_top_seconds (P1: p1_seconds, P2:
        # p2_seconds + p1_seconds). Otherwise a derived bound would undo the
        # aging promise (a P2 request reaches P0 within 60 s) and reject
        # offline work that merely waits its turn behind interactive traffic.
        self._metrics = metrics
        self._windows: dict[tuple[DeadlineKind, str, int], LatencyWindow] = {}
        self._keys: set[tuple[str, int]] = set()   # (model, class) seen, for GetState and gauges
        # Prompt sizes of the first-token samples: a longer prompt than their
        # p95 gets a proportionally longer first-token deadline (`stamp`).
        self._prompts: dict[tuple[str, int], LatencyWindow] = {}
        self._last: dict[tuple[DeadlineKind, str, int], Deadline] = {}   # `_clamp`'s last answer per key

    @property
    def enabled(self) -> bool:
        return self._config.enabled

    # ---------------------------------------------------------------- samples

    def observe(self, kind: DeadlineKind, model: str, priority: int, seconds: float, now: float) -> None:
        if not self._config.enabled:
            return
        self._window(kind, model, priority).add(seconds, now)

    def observe_gaps(self, model: str, priority: int, gaps: Sequence[float], now: float) -> None:
        if not self._config.enabled or not gaps:
            return
        window = self._window(DeadlineKind.TOKEN_STALL, model, priority)
        for gap in gaps:
            if math.isfinite(gap):
                window.add(gap, now)

    def first_token(self, rec: RequestRecord, now: float) -> None:
        """The gateway told `FirstToken` for `rec`'s lease (a re-attached
        lease began mid-stream: its first token is no sample)."""
        if rec.lease is None or rec.options.running_on_engine or not self._config.enabled:
            return
        key = (rec.options.model, rec.options.priority)
        self.observe(DeadlineKind.FIRST_TOKEN, *key, now - rec.lease.placed_at, now)
        sizes = self._prompts.get(key)
        if sizes is None:
            # As stale as the latency windows may be: it is read at every placement.
            sizes = self._prompts[key] = LatencyWindow(self._config.window_samples, self._config.window_seconds,
                                                       _P95_STALENESS_SECONDS)
        sizes.add(float(rec.options.prompt_tokens), now)

    def queued(self, options: AdmitOptions, base_class: int, waited: float, now: float) -> None:
        """A request left the queue for an engine after `waited` seconds. The
        wait of a class without a derived bound (batch lines) is no sample: it
        waits behind every other class by design, and its hours would raise
        P2's bound for everyone."""
        if self._classes[options.klass].derived_queue_bound:
            self.observe(DeadlineKind.QUEUE_WAIT, options.model, base_class, waited, now)

    def queue_expiry(self, options: AdmitOptions, limit_expiry: float, arrival: float,
                     now: float) -> tuple[float, str]:
        """When a request admitted now expires from the queue, and why: the
        derived bound, never later than the class TTL (`limit_expiry`); a
        class without a derived bound (a batch line: its batch's completion
        window) has its TTL alone."""
        rules = self._classes[options.klass]
        if not rules.derived_queue_bound:
            return limit_expiry, rules.fixed_ttl_reason
        bound = self.queue_bound(options.model, options.priority, now)
        return min(limit_expiry, arrival + bound.seconds), bound.describe()

    def expired(self, entry: QueueEntry, now: float) -> str:
        """A queued request ran out of time: its wait counts (so a backlog
        raises the p95 rather than hiding from it); returns the message."""
        waited = now - entry.arrival
        self.queued(entry.options, entry.base_class, waited, now)
        return (f"waited {waited:.1f} s in the queue, past the P{entry.base_class} queue-wait deadline, "
                f"{entry.ttl_reason or 'its time-to-live'}")

    def _window(self, kind: DeadlineKind, model: str, priority: int) -> LatencyWindow:
        key = (kind, model, priority)
        window = self._windows.get(key)
        if window is None:
            window = self._windows[key] = LatencyWindow(
                self._config.window_samples, self._config.window_seconds, _P95_STALENESS_SECONDS)
            self._keys.add((model, priority))
        return window

    # ---------------------------------------------------------------- deadlines

    def ceiling(self, kind: DeadlineKind, priority: int) -> float:
        """Today's fixed value for `kind` (the configured ceiling caps it)."""
        configured = self._bounds(kind).ceiling_seconds
        if kind is DeadlineKind.QUEUE_WAIT:
            fixed = self._rank(priority).ttl_seconds
        elif kind is DeadlineKind.GENERATION:
            fixed = self._max_generation
        else:
            fixed = self._hang_floor
        if kind in (DeadlineKind.QUEUE_WAIT, DeadlineKind.GENERATION):
            return min(fixed, configured) if configured > 0 else fixed
        return configured if configured > 0 else fixed

    def _rank(self, priority: int) -> ClassRules:
        """The ladder class of `priority` (clamped: a label never fails)."""
        return self._classes.at_rank(min(max(priority, 0), len(ClassTable.ladder()) - 1))

    def _bounds(self, kind: DeadlineKind) -> DeadlineBounds:
        bounds: DeadlineBounds = getattr(self._config, kind.value)
        return bounds

    def deadline(self, kind: DeadlineKind, model: str, priority: int, now: float) -> Deadline:
        """One windowed kind's deadline now (not GENERATION: see `generation`)."""
        window = self._windows.get((kind, model, priority))
        samples = 0 if window is None else window.count(now)
        p95 = None if window is None else window.p95(now)
        return self._clamp(kind, model, priority, p95, samples, now)

    def generation(self, model: str, priority: int, max_tokens: int, now: float) -> Deadline:
        first = self.deadline(DeadlineKind.FIRST_TOKEN, model, priority, now)
        gap = self.deadline(DeadlineKind.TOKEN_STALL, model, priority, now)
        estimate = None
        if first.p95 is not None and gap.p95 is not None and Source.DEFAULT not in (first.source, gap.source):
            estimate = first.p95 + max(1, max_tokens) * gap.p95
        return self._clamp(DeadlineKind.GENERATION, model, priority, estimate,
                           min(first.samples, gap.samples), now)

    def _clamp(self, kind: DeadlineKind, model: str, priority: int, p95: float | None, samples: int,
               now: float) -> Deadline:
        """The deadline from a p95 and its sample count: the last one made for
        (kind, model, class) again when both are unchanged -- the usual case:
        a placement asks for five, and admission describes one in its TTL
        reason (`Deadline.describe`, formatted once per deadline)."""
        key = (kind, model, priority)
        last = self._last.get(key)
        if last is not None and last.p95 == p95 and last.samples == samples:
            return last
        made = self._last[key] = self._made(kind, model, priority, p95, samples)
        return made

    def _made(self, kind: DeadlineKind, model: str, priority: int, p95: float | None, samples: int) -> Deadline:
        ceiling = self.ceiling(kind, priority)
        if not self._config.enabled or p95 is None or samples < self._config.min_samples:
            return Deadline(kind, model, priority, ceiling, p95, samples, Source.DEFAULT)
        value, source = self._config.multiple * p95, Source.DERIVED
        floor = self._bounds(kind).floor_seconds
        if kind is DeadlineKind.QUEUE_WAIT:
            floor += self._rank(priority).aging_to_top_seconds
        if value < floor:
            value, source = floor, Source.FLOOR
        if value > ceiling:  # after the floor: nothing is looser than the ceiling
            value, source = ceiling, Source.CEILING
        return Deadline(kind, model, priority, value, p95, samples, source)

    def queue_bound(self, model: str, priority: int, now: float) -> Deadline:
        """The queue-wait bound a request admitted now gets."""
        return self.deadline(DeadlineKind.QUEUE_WAIT, model, priority, now)

    def stamp_all(self, notices: list[Delivery], record: Callable[[str], RequestRecord | None],
                  now: float) -> None:
        """Give every placement in `notices` the deadlines the gateway
        enforces (in place; everything else is left as it is)."""
        if not self._config.enabled:
            return
        for i, (request_id, notice) in enumerate(notices):
            if isinstance(notice, PlacedInfo) and (rec := record(request_id)) is not None:
                notices[i] = (request_id, self.stamp(notice, rec.options, now))

    def stamp(self, notice: PlacedInfo, options: AdmitOptions, now: float) -> PlacedInfo:
        """`notice` with the deadlines the gateway enforces for `options`."""
        model, priority = options.model, options.priority
        stall = self.deadline(DeadlineKind.TOKEN_STALL, model, priority, now)
        return replace(notice, deadlines=PlacedDeadlines(
            self.first_token_for(model, priority, options.prompt_tokens, now).seconds,
            stall.seconds,
            self.generation(model, priority, options.max_tokens, now).seconds,
            stall.p95 or 0.0,
        ))

    def first_token_for(self, model: str, priority: int, prompt_tokens: int, now: float) -> Deadline:
        """The first-token deadline for a prompt of `prompt_tokens` (after a
        migration: prompt + generated): scaled up by prompt / p95 prompt of
        the samples when longer, since prefill grows with it."""
        base = self.deadline(DeadlineKind.FIRST_TOKEN, model, priority, now)
        sizes = self._prompts.get((model, priority))
        typical = None if sizes is None else sizes.p95(now)
        if base.source is Source.DEFAULT or base.p95 is None or not typical or prompt_tokens <= typical:
            return base
        return self._clamp(DeadlineKind.FIRST_TOKEN, model, priority, base.p95 * prompt_tokens / typical,
                           base.samples, now)

    # ---------------------------------------------------------------- views

    def states(self, now: float, max_tokens: int = 256) -> list[Deadline]:
        """Every (model, class) seen, each kind; `generation` for a request
        of `max_tokens` (GetState shows a typical one)."""
        out: list[Deadline] = []
        for model, priority in sorted(self._keys):
            out.extend(self.deadline(kind, model, priority, now) for kind in _WINDOWED)
            out.append(self.generation(model, priority, max_tokens, now))
        return out

    def refresh_metrics(self, now: float) -> None:
        if self._metrics is None:
            return
        for d in self.states(now):
            labels = (d.kind.value, d.model, priority_label(d.priority))
            self._metrics.deadline_seconds.labels(*labels).set(d.seconds)
            self._metrics.latency_p95_seconds.labels(*labels).set(d.p95 or 0.0)
