"""The scheduler's scaling policy: the engines each model needs, from the
scheduler's own measurements, published as `kvmesh_scheduler_desired_engines`
and in GetState for an actuator (`kvmesh up --autoscale`, KEDA) to follow.

    demand.py   arrival rate per class, prompt/output lengths, cache share
    signals.py  engines (serving, KV use, calibrated profile) and queue per model
    policy.py   need (steady state / reactive / demand) and hysteresis (Stepper)
    scaler.py   the core's part: count, decide per interval, publish
"""

from .policy import Need, Stepper, need
from .scaler import Scaler, ScalingDecision, spares_for

__all__ = ["Need", "Scaler", "ScalingDecision", "Stepper", "need", "spares_for"]
