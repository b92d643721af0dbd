"""What KEDA and the HPA it makes decide from a rendered ScaledObject, as
pure arithmetic on an injected clock (the harness has no KEDA; keda.py runs
this against the real metric).

Kubernetes' HPA with one External metric of target type AverageValue:
desired = ceil(value / threshold), unchanged while value / (threshold x
current) is within the tolerance (10%) of 1; clamped to [min, max]
(KEDA's minReplicaCount / maxReplicaCount); then the behavior: a
recommendation to scale down takes the highest recommendation of the last
stabilizationWindowSeconds (scale-up: the lowest of its own window), and the
change is limited by the policies (Pods: at most `value` pods per
`periodSeconds`, counting the changes already made in that period;
Percent: `value`% of the replicas at the period's start; selectPolicy Max
takes the policy allowing the most change, Min the least). KEDA's own part:
with minReplicaCount 0, a value at or below activationThreshold makes 0
once cooldownPeriod has passed since the last active reading. Defaults are
the HPA's (scale-up: no window, max(100%, 4 pods) per 15 s; scale-down:
300 s, 100% per 15 s).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Policy", "ScalePolicy", "Scaling"]

TOLERANCE = 0.1


@dataclass(frozen=True)
class Policy:
    kind: str  # "Pods" | "Percent"
    value: int
    period: float


@dataclass(frozen=True)
class ScalePolicy:
    """One direction's behavior (HPAScalingRules)."""

    window: float
    policies: tuple[Policy, ...]
    select: str  # "Max" | "Min" | "Disabled"

    @staticmethod
    def of(rules: dict[str, Any], default: ScalePolicy) -> ScalePolicy:
        policies = tuple(Policy(p["type"], int(p["value"]), float(p["periodSeconds"]))
                         for p in rules.get("policies", [])) or default.policies
        return ScalePolicy(float(rules.get("stabilizationWindowSeconds", default.window)), policies,
                           str(rules.get("selectPolicy", "Max")))


UP_DEFAULT = ScalePolicy(0.0, (Policy("Percent", 100, 15.0), Policy("Pods", 4, 15.0)), "Max")
DOWN_DEFAULT = ScalePolicy(300.0, (Policy("Percent", 100, 15.0),), "Max")


@dataclass
class Scaling:
    """The decisions for one ScaledObject with one trigger."""

    minimum: int
    maximum: int
    threshold: float
    activation: float
    cooldown: float
    up: ScalePolicy
    down: ScalePolicy
    recommendations: list[tuple[float, int]] = field(default_factory=list)  # (time, desired before behavior)
    changes: list[tuple[float, int]] = field(default_factory=list)  # (time, replicas added (+) or removed (-))
    last_active: float | None = None

    @staticmethod
    def of(scaled_object: dict[str, Any]) -> Scaling:
        spec = scaled_object["spec"]
        meta = spec["triggers"][0]["metadata"]
        behavior = spec.get("advanced", {}).get("horizontalPodAutoscalerConfig", {}).get("behavior", {})
        return Scaling(int(spec.get("minReplicaCount", 0)), int(spec.get("maxReplicaCount", 100)),
                       float(meta["threshold"]), float(meta.get("activationThreshold", 0)),
                       float(spec.get("cooldownPeriod", 300)), ScalePolicy.of(behavior.get("scaleUp", {}), UP_DEFAULT),
                       ScalePolicy.of(behavior.get("scaleDown", {}), DOWN_DEFAULT))

    def raw(self, value: float, current: int) -> int:
        """The HPA's formula with its tolerance, clamped to [min, max]."""
        if current > 0 and abs(value / (self.threshold * current) - 1) <= TOLERANCE:
            desired = current
        else:
            desired = math.ceil(value / self.threshold)
        return max(self.minimum, min(self.maximum, desired))

    def decide(self, now: float, value: float, current: int) -> int:
        """The replicas after this reading (records it and the change made)."""
        if value > self.activation or self.last_active is None:
            self.last_active = now
        # KEDA sets the HPA's floor to 1; only KEDA itself goes to 0.
        if self.minimum == 0 and value <= self.activation and now - self.last_active >= self.cooldown:
            if current:  # KEDA scales the target to 0 itself, past the HPA's policies
                self.changes.append((now, -current))
            return 0
        target = max(self.raw(value, current), 1)
        self.recommendations.append((now, target))
        keep = max(self.up.window, self.down.window)
        self.recommendations = [(t, r) for t, r in self.recommendations if now - t <= keep]
        if target > current:
            target = min(r for t, r in self.recommendations if now - t <= self.up.window)
            target = min(max(target, current), self._limit(now, current, self.up, +1))
        elif target < current:
            target = max(r for t, r in self.recommendations if now - t <= self.down.window)
            target = max(min(target, current), self._limit(now, current, self.down, -1))
        if target != current:
            self.changes.append((now, target - current))
        return target

    def _limit(self, now: float, current: int, rules: ScalePolicy, sign: int) -> int:
        """The furthest the policies let the replicas go from `current` in direction `sign`."""
        if rules.select == "Disabled":
            return current
        limits = []
        for p in rules.policies:
            made = sum(d for t, d in self.changes if now - t < p.period and d * sign > 0)
            start = current - made  # the replicas at the period's start
            step = p.value if p.kind == "Pods" else math.ceil(start * p.value / 100)
            limits.append(start + sign * step)
        pick = max if (rules.select == "Max") == (sign > 0) else min
        return pick(limits)
