"""Deadlines learned from live latency (services/scheduler/deadlines.py).

The scheduler keeps, per (model, priority class), sliding windows of the
fleet's latency: queue wait (it sees it), placement -> first token (it sees
`Placed` and the gateway's `FirstToken`) and the gaps between a stream's
deltas (the gateway samples them into `RequestDone`). Each deadline is

    clamp(multiple x p95, floor_seconds, ceiling)

once its window holds `min_samples` samples; before that it is the ceiling
(source "default"), which is today's fixed value, so a cold mesh behaves as
it always did. Ceilings default to the fixed numbers the mesh used before,
so a derived deadline is never looser than the old rule; floors keep a noisy
machine's healthy streams from being cut or moved.

Where each is enforced: queue_wait by the scheduler (a request still queued
after it is rejected `expired`, 503); first_token and token_stall by the
gateway's driver (a stream with no token for that long has lost its engine:
it migrates, within `gateway.max_migrations`); generation by the driver too
(the whole generation's limit; `gateway.max_generation_seconds` and a key's
or request's own limit stay ceilings).
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["DeadlineBounds", "DeadlinesConfig"]


@dataclass
class DeadlineBounds:
    """Floor and ceiling of one derived deadline, in seconds."""

    # The derived value never goes below this. > 0.
    floor_seconds: float = 1.0
    # Nor above this; 0 = the fixed value the kind had before (see each
    # kind in DeadlinesConfig). A floor above the ceiling yields the ceiling
    # (nothing gets looser than the ceiling). >= 0.
    ceiling_seconds: float = 0.0


@dataclass
class DeadlinesConfig:
    """`deadlines`: how the mesh's timeouts follow its live p95 latencies."""

    # Off = the fixed values of before: scheduler.queue_ttl_seconds,
    # gateway.max_generation_seconds, and no stall watch in the gateway (a
    # stalled stream waits for keepalive or the engine's hang detector).
    enabled: bool = True
    # Deadline = multiple x p95. 3: the articles' rule; a healthy request
    # lands past 3x the p95 rarely enough that moving it costs little.
    # Bounds: 1 .. 100.
    multiple: float = 3.0
    # Samples a window must hold before its p95 replaces the ceiling: 20
    # gives a p95 that is the 19th of 20 values at least, not one outlier.
    # Bounds: >= 1 and <= window_samples.
    min_samples: int = 20
    # Window bounds, both apply: the newest window_samples samples of the
    # last window_seconds. 1000 / 300 s: a minute or five of a busy class,
    # so the p95 follows a speed change within seconds (5% new samples move
    # a p95 up) and forgets a slow spell within five minutes. > 0 each.
    window_samples: int = 1000
    window_seconds: float = 300.0
    # Time in the queue before `expired` (503). Ceiling 0 = the class's
    # scheduler.queue_ttl_seconds. Floor 20 s: an idle fleet's p95 wait is
    # ~0, and a burst arriving then must still get time for a few
    # generations (and a 2-5 s scheduler restart) to clear before it is
    # turned away. P1's and P2's floors add their aging time to P0
    # (scheduler.aging: 30 s and 60 s by default), so a request always gets
    # the time to age to P0 and P0's floor there. A batch line's expiry is
    # its batch's completion window, never this.
    queue_wait: DeadlineBounds = field(default_factory=lambda: DeadlineBounds(20.0, 0.0))
    # Placement -> the first token on that engine, watched by the gateway.
    # A prompt longer than the window's p95 prompt gets proportionally more
    # (prefill grows with it). Floor 10 s: a long prompt's prefill behind a
    # full batch takes seconds on a loaded GPU, and a 2-core CI machine adds
    # seconds of scheduling delay. Ceiling 0 = the engine's own hang floor
    # (engines.template.hang_floor_seconds, 30 s), the first fixed bound
    # that caught a silent engine before.
    first_token: DeadlineBounds = field(default_factory=lambda: DeadlineBounds(10.0, 0.0))
    # No delta for this long mid-stream = the engine is lost: migrate.
    # Floor 5 s: a healthy stream on a loaded 2-core machine shows gaps of
    # 1-2 s (GC, event-loop stalls, a long prefill chunk in the same step,
    # vLLM's own recompute preemption); 5 s is well above that and 6x
    # under the engine's 30 s hang floor. Ceiling 0 = that hang floor
    # (engines.template.hang_floor_seconds).
    token_stall: DeadlineBounds = field(default_factory=lambda: DeadlineBounds(5.0, 0.0))
    # The whole generation: multiple x (p95 first token + max_tokens x p95
    # gap). Ceiling 0 = gateway.max_generation_seconds (a key's or the
    # request's own limit applies too). Floor 30 s: the estimate assumes the
    # stream runs alone at today's pace; preemption waits and a slower
    # engine after a migration must not end a healthy generation.
    generation: DeadlineBounds = field(default_factory=lambda: DeadlineBounds(30.0, 0.0))
