"""The HPA/KEDA stand-in's arithmetic (hpa.py) on a fake clock: the formula,
its tolerance and clamp, the scale-down window and pace, scale to zero."""

from __future__ import annotations

from typing import Any

from .hpa import Scaling


def _so(**spec: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "minReplicaCount": 1, "maxReplicaCount": 8, "cooldownPeriod": 300,
        "triggers": [{"type": "prometheus", "metricType": "AverageValue",
                      "metadata": {"threshold": "1", "activationThreshold": "0"}}],
        "advanced": {"horizontalPodAutoscalerConfig": {"behavior": {
            "scaleUp": {"stabilizationWindowSeconds": 0,
                        "policies": [{"type": "Pods", "value": 4, "periodSeconds": 15}]},
            "scaleDown": {"stabilizationWindowSeconds": 300, "selectPolicy": "Min",
                          "policies": [{"type": "Pods", "value": 1, "periodSeconds": 120}]}}}}}
    base.update(spec)
    return {"spec": base}


def test_the_replicas_are_the_figure_within_bounds() -> None:
    s = Scaling.of(_so())
    assert [s.raw(v, 2) for v in (0, 1, 2, 2.15, 2.3, 3, 7.2, 50)] == [1, 1, 2, 2, 3, 3, 8, 8]
    assert s.decide(0, 3, 1) == 3  # up at once


def test_scale_up_is_paced_by_its_policy() -> None:
    s = Scaling.of(_so())
    assert s.decide(0, 8, 1) == 5  # 4 pods per 15 s
    assert s.decide(5, 8, 5) == 5
    assert s.decide(15, 8, 5) == 8


def test_scale_down_waits_out_the_window_then_goes_one_pod_per_period() -> None:
    s = Scaling.of(_so())
    current = s.decide(0, 4, 1)
    assert current == 4
    for t in range(5, 300, 5):
        assert s.decide(t, 1, current) == 4, t  # the highest of the last 300 s is still 4
    current = s.decide(301, 1, current)
    assert current == 3
    assert s.decide(400, 1, current) == 3  # one pod per 120 s
    current = s.decide(421, 1, current)
    assert current == 2
    assert s.decide(541, 1, current) == 1


def test_a_short_lull_is_ignored() -> None:
    s = Scaling.of(_so())
    current = s.decide(0, 3, 1)
    assert s.decide(100, 1, current) == 3
    assert s.decide(200, 3, current) == 3
    assert s.decide(450, 1, current) == 3  # 3 was seen at 200: still within 300 s


def test_scale_to_zero_after_the_cooldown_and_back() -> None:
    s = Scaling.of(_so(minReplicaCount=0, cooldownPeriod=60))
    s.down = s.down.__class__(0.0, s.down.policies, "Max")  # no window: the cooldown alone
    assert s.decide(0, 2, 2) == 2
    assert s.decide(10, 0, 2) == 1  # inactive, but within the cooldown: the HPA's floor
    assert s.decide(59, 0, 1) == 1
    assert s.decide(71, 0, 1) == 0
    assert s.decide(72, 0.5, 0) == 1  # active again


def test_the_hpa_defaults_without_a_behavior() -> None:
    so = _so()
    del so["spec"]["advanced"]
    s = Scaling.of(so)
    assert s.decide(0, 6, 1) == 5  # max(100% of 1, 4 pods) per 15 s
    assert s.down.window == 300
