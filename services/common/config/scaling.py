"""Fleet scaling settings, under `scheduler.scaling` in the YAML: the
scheduler's one scaling policy (services/scheduler/scaling/), which
publishes the engines each model needs (`kvmesh_scheduler_desired_engines`,
GetState, `kvmesh top`) for an actuator to follow -- `kvmesh up
--autoscale MIN:MAX` here, a KEDA ScaledObject on Kubernetes. Bounds are
checked at load by `validation.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["ScalingConfig"]


@dataclass
class ScalingConfig:
    """What the policy aims at, how fast it moves, and within what bounds."""

    # Off = the desired count is still computed and published (an operator
    # can watch what the policy would do), but no model is treated as
    # autoscaled: a request for a model with no engine is refused after
    # scheduler.engine_grace_seconds as before. On (`kvmesh up --autoscale`
    # sets it) = every configured model is autoscaled: with no engine, its
    # requests queue (heartbeats on) for up to cold_start_wait_seconds while
    # one starts (scale from zero).
    enabled: bool = False
    # Seconds between two decisions. 5 s: a sim engine starts in ~3 s, so the
    # fleet follows a ramp within a few intervals; each decision moves at
    # most max_step_up / max_step_down engines. > 0.
    interval_seconds: float = 5.0
    # The published count is clamped to [min_engines, max_engines] (the
    # actuator's own MIN:MAX; `kvmesh up --autoscale` writes them here).
    # 0 <= min <= max.
    min_engines: int = 0
    max_engines: int = 64
    # First-token target per class [P0, P1, P2] in seconds, at `quantile`:
    # the seeds' P0 < 500 ms and P1 < 2 s; P2 (offline) 20 s. Each > 0.
    ttft_targets_seconds: list[float] = field(default_factory=lambda: [0.5, 2.0, 20.0])
    # The quantile the steady-state arithmetic (services/planning: Little's
    # law, Erlang C split by class) meets the targets at. 0.5 .. < 1.
    quantile: float = 0.95
    # Arrival rate smoothing, seconds (exponential time constants): the
    # fast rate drives scale-out (a ramp shows within seconds), the slow
    # one scale-in (a lull must last before engines go). 0 < fast <= slow.
    fast_rate_seconds: float = 10.0
    slow_rate_seconds: float = 60.0
    # Scale-in happens only after the policy wanted fewer engines for this
    # long without a break: in slowly, so a dip between bursts does not send
    # engines away that the next burst needs (and a cold start costs 30-60 s
    # on vLLM). >= 0.
    scale_in_hold_seconds: float = 60.0
    # Most engines one decision adds / removes. Out fast (2 per interval),
    # in slowly (1). >= 1 each.
    max_step_up: int = 2
    max_step_down: int = 1
    # A queue-wait miss adds one engine over those serving: the oldest P0 or
    # P1 request queued longer than this share of its class's target. 0 .. 1.
    queue_wait_share: float = 1.0
    # KV pressure: mean KV use of a model's serving engines above this adds
    # one engine (placement starts refusing for room near 1.0). 0 .. 1.
    kv_pressure: float = 0.9
    # Scale from zero: a request for an autoscaled model with no engine
    # waits this long from its arrival (queued, with heartbeats) for one to
    # start, whatever its class TTL; then it is refused NO_ENGINE. 120 s
    # covers a vLLM cold start on CPU (~45 s) with room. >= 0.
    cold_start_wait_seconds: float = 120.0
