"""The autoscaling overlay's wiring (wiring_autoscaling.py), and each check
failing on a manifest broken the way it guards against."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import yaml

from .breaking import broken, config_edit
from .manifests import DEPLOY, Obj, render
from .wiring import find
from .wiring_autoscaling import (
    DESIRED_ENGINES,
    check_prometheus_address,
    check_scale_down,
    check_scale_target,
    check_scaling_query,
)

OVERLAY = "overlays/autoscaling"
CHECKS = (check_scale_target, check_scaling_query, check_prometheus_address, check_scale_down)


def _so(objects: list[Obj]) -> Obj:
    so = find(objects, "ScaledObject", "kvmesh-engine")
    assert so is not None
    return so


def _trigger(objects: list[Obj]) -> dict[str, str]:
    return dict(_so(objects)["spec"]["triggers"][0]["metadata"])


def _edit_trigger(key: str, value: str) -> Callable[[list[Obj]], None]:
    def change(objects: list[Obj]) -> None:
        _so(objects)["spec"]["triggers"][0]["metadata"][key] = value
    return change


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_the_overlay_scales_the_engines_on_the_schedulers_figure(check: Callable[[list[Obj]], list[str]]) -> None:
    assert check(render(OVERLAY)) == []


def test_the_replicas_are_the_figure() -> None:
    so = _so(render(OVERLAY))
    trigger = so["spec"]["triggers"][0]
    assert (trigger["type"], trigger["metricType"], trigger["metadata"]["threshold"]) == \
        ("prometheus", "AverageValue", "1")
    assert trigger["metadata"]["query"] == f'max({DESIRED_ENGINES}{{model="SmolLM2-135M-Instruct"}})'
    assert so["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "kvmesh-engine"}
    assert "replicas" not in find(render(OVERLAY), "StatefulSet", "kvmesh-engine")["spec"]


def test_a_target_that_does_not_exist_fails() -> None:
    def rename(objects: list[Obj]) -> None:
        _so(objects)["spec"]["scaleTargetRef"]["name"] = "kvmesh-engines"
    problems = check_scale_target(broken(rename, OVERLAY))
    assert any("StatefulSet/kvmesh-engines (apps/v1) is no workload" in p for p in problems), problems

    def deployment(objects: list[Obj]) -> None:
        _so(objects)["spec"]["scaleTargetRef"]["kind"] = "Deployment"
    assert any("is no workload" in p for p in check_scale_target(broken(deployment, OVERLAY)))

    def gateways(objects: list[Obj]) -> None:
        _so(objects)["spec"]["scaleTargetRef"].update(kind="Deployment", name="kvmesh-gateway")
    assert any("not an engine workload" in p for p in check_scale_target(broken(gateways, OVERLAY)))

    def pinned(objects: list[Obj]) -> None:
        find(objects, "StatefulSet", "kvmesh-engine")["spec"]["replicas"] = 3
    assert any("sets replicas" in p for p in check_scale_target(broken(pinned, OVERLAY)))

    def no_drain(objects: list[Obj]) -> None:
        find(objects, "StatefulSet", "kvmesh-engine")["spec"]["template"]["spec"]["containers"][0].pop("lifecycle")
    assert any("no `kvmesh drain` preStop" in p for p in check_scale_target(broken(no_drain, OVERLAY)))


def test_a_metric_the_scheduler_does_not_export_fails() -> None:
    query = _trigger(render(OVERLAY))["query"]
    wrong = broken(_edit_trigger("query", query.replace(DESIRED_ENGINES, "kvmesh_scheduler_desired_replicas")),
                   OVERLAY)
    problems = check_scaling_query(wrong)
    assert any("kvmesh_scheduler_desired_replicas is no series the scheduler exports" in p for p in problems)
    assert any(f"does not read {DESIRED_ENGINES}" in p for p in problems), problems
    # A gateway's series is exported, but not by the scheduler.
    gateway = broken(_edit_trigger("query", "sum(kvmesh_gateway_requests_total)"), OVERLAY)
    assert any("kvmesh_gateway_requests_total is no series the scheduler exports" in p
               for p in check_scaling_query(gateway))
    other_model = broken(_edit_trigger("query", query.replace("SmolLM2-135M-Instruct", "tiny-llama")), OVERLAY)
    assert any("selects model ['tiny-llama']" in p for p in check_scaling_query(other_model))
    assert any("threshold 2" in p for p in check_scaling_query(broken(_edit_trigger("threshold", "2"), OVERLAY)))


def test_a_prometheus_address_no_service_provides_fails() -> None:
    address = _trigger(render(OVERLAY))["serverAddress"]
    for wrong in (address.replace("kvmesh-prometheus", "prometheus-operated"),
                  address.replace(".kvmesh.svc", ".monitoring.svc"),
                  address.replace(":9090", ":9091"),
                  "http://kvmesh-scheduler.kvmesh.svc.cluster.local:9101"):
        problems = check_prometheus_address(broken(_edit_trigger("serverAddress", wrong), OVERLAY))
        assert any(f"serverAddress {wrong} is no Service" in p for p in problems), (wrong, problems)

    def no_prometheus(objects: list[Obj]) -> None:
        objects.remove(find(objects, "Deployment", "kvmesh-prometheus"))  # type: ignore[arg-type]  # find returns the object it found, typed loosely
    assert any("is no Service" in p for p in check_prometheus_address(broken(no_prometheus, OVERLAY)))


def test_a_prometheus_that_cannot_see_the_schedulers_fails() -> None:
    def scrape_gateways(objects: list[Obj]) -> None:
        cm = next(o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"].startswith("kvmesh-prom"))
        cm["data"]["prometheus.yml"] = cm["data"]["prometheus.yml"].replace("kvmesh-scheduler.", "kvmesh-gateway.")
    assert any("not the scheduler replicas' metrics port 9101" in p
               for p in check_prometheus_address(broken(scrape_gateways, OVERLAY)))

    def no_policy(objects: list[Obj]) -> None:
        objects.remove(find(objects, "NetworkPolicy", "kvmesh-scheduler-metrics-from-prometheus"))  # type: ignore[arg-type]  # find returns the object it found, typed loosely
    assert any("keep it from the schedulers' metrics port 9101" in p
               for p in check_prometheus_address(broken(no_policy, OVERLAY)))

    def no_keda(objects: list[Obj]) -> None:
        objects.remove(find(objects, "NetworkPolicy", "kvmesh-prometheus-from-keda"))  # type: ignore[arg-type]  # find returns the object it found, typed loosely
    assert any("keep KEDA (namespace keda) from port 9090" in p
               for p in check_prometheus_address(broken(no_keda, OVERLAY)))


def test_a_fast_scale_down_fails() -> None:
    def down(objects: list[Obj]) -> dict[str, object]:
        return dict(_so(objects)["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"])

    def edit(**values: object) -> Callable[[list[Obj]], None]:
        def change(objects: list[Obj]) -> None:
            _so(objects)["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"].update(values)
        return change
    assert down(render(OVERLAY))["stabilizationWindowSeconds"] >= 60
    assert any("stabilization 0 s" in p for p in check_scale_down(broken(edit(stabilizationWindowSeconds=0), OVERLAY)))
    two = edit(policies=[{"type": "Pods", "value": 2, "periodSeconds": 120}])
    assert any("more than one pod per 30 s" in p for p in check_scale_down(broken(two, OVERLAY)))
    quick = edit(policies=[{"type": "Pods", "value": 1, "periodSeconds": 10}])
    assert any("more than one pod per 30 s" in p for p in check_scale_down(broken(quick, OVERLAY)))
    percent_max = edit(selectPolicy="Max", policies=[{"type": "Pods", "value": 1, "periodSeconds": 120},
                                                    {"type": "Percent", "value": 50, "periodSeconds": 60}])
    assert any("selectPolicy Max" in p for p in check_scale_down(broken(percent_max, OVERLAY)))

    def no_behavior(objects: list[Obj]) -> None:
        del _so(objects)["spec"]["advanced"]
    assert any("Percent" in p for p in check_scale_down(broken(no_behavior, OVERLAY)))


def test_the_schedulers_bounds_are_the_replicas_bounds() -> None:
    problems = check_scaling_query(broken(config_edit("max_engines: 8", "max_engines: 6"), OVERLAY))
    assert any("scheduler.scaling bounds 1..6 differ from ScaledObject/kvmesh-engine's replicas 1..8" in p
               for p in problems), problems
    off = config_edit("enabled: true\n    min_engines", "enabled: false\n    min_engines")
    problems = check_scaling_query(broken(off, OVERLAY))
    assert any("scheduler.scaling.enabled is off" in p for p in problems), problems

    def more(objects: list[Obj]) -> None:
        _so(objects)["spec"]["maxReplicaCount"] = 12
    assert any("replicas 1..12" in p for p in check_scaling_query(broken(more, OVERLAY)))


def test_the_mesh_config_is_dev_cpus_plus_the_scaling_policy() -> None:
    mine = yaml.safe_load((DEPLOY / "overlays" / "autoscaling" / "kvmesh.yaml").read_text())
    dev = yaml.safe_load((DEPLOY / "overlays" / "dev-cpu" / "kvmesh.yaml").read_text())
    scaling = mine["scheduler"].pop("scaling")
    assert mine == dev and scaling["enabled"] is True
