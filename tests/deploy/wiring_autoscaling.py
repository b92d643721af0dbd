"""Cross-checks of the autoscaling overlay (deploy/overlays/autoscaling):
KEDA's ScaledObject against the workloads, the scheduler's metrics and the
Prometheus it asks.

- check_scale_target: the ScaledObject's scaleTargetRef names a workload
  the overlay has (kind, name, apps/v1), an engine workload (the figure
  counts engines), whose manifest sets no `replicas` (an apply would undo
  the autoscaler) and whose pods drain on preStop;
- check_scaling_query: each trigger is a Prometheus query naming only
  series the scheduler exports (services/observability/metric_catalogue.py),
  the `model` it selects is the model the target's engines serve, and the
  replicas are the figure itself (metricType AverageValue, threshold 1);
  min <= max, and they are the scheduler's own bounds for the figure
  (`scheduler.scaling.min_engines/max_engines`, with `enabled` on);
- check_prometheus_address: the trigger's serverAddress is a Service of the
  overlay on a port a Prometheus pod listens on, that Prometheus scrapes the
  scheduler replicas' metrics port (its mounted prometheus.yml), and the
  NetworkPolicies let it reach them and let KEDA (namespace `keda`) reach it;
- check_scale_down: scale-down is slow -- a stabilization window of at
  least MIN_STABILIZATION_SECONDS and at most one pod per period, each
  period at least the target pod's terminationGracePeriodSeconds (one
  engine's drain ends before the next one starts).
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

import yaml

from .manifests import Obj, ident
from .wiring import (
    Pod,
    listening_ports,
    mesh_config,
    namespace,
    pod_labels,
    pod_of,
    pods,
    policy_allows,
    service_target,
)

__all__ = ["DESIRED_ENGINES", "MIN_STABILIZATION_SECONDS", "check_prometheus_address", "check_scale_down",
           "check_scale_target", "check_scaling_query", "scaled_objects"]

# The scheduler's figure (the `autoscale` work, issue 28): engines wanted per model, spares included.
DESIRED_ENGINES = "kvmesh_scheduler_desired_engines"
# Below a minute a lull between bursts would let engines go that the next
# burst needs again (a vLLM engine takes 30-60 s to start).
MIN_STABILIZATION_SECONDS = 60
KEDA_NAMESPACE = "keda"


def scaled_objects(objects: list[Obj]) -> list[Obj]:
    return [o for o in objects if o["kind"] == "ScaledObject"]


def _target(objects: list[Obj], so: Obj) -> Pod | None:
    ref = so["spec"]["scaleTargetRef"]
    kind, api = ref.get("kind", "Deployment"), ref.get("apiVersion", "apps/v1")
    return next((p for p in pods(objects) if p.workload["kind"] == kind and p.workload["metadata"]["name"]
                 == ref["name"] and p.workload.get("apiVersion") == api), None)


def check_scale_target(objects: list[Obj]) -> list[str]:
    problems = []
    for so in scaled_objects(objects):
        pod = _target(objects, so)
        ref = so["spec"]["scaleTargetRef"]
        if pod is None:
            problems.append(f"{ident(so)}: scaleTargetRef {ref.get('kind', 'Deployment')}/{ref['name']} "
                            f"({ref.get('apiVersion', 'apps/v1')}) is no workload of the overlay")
            continue
        if pod.component != "engine":
            problems.append(f"{ident(so)}: scales {pod.name}, not an engine workload (the figure counts engines)")
        if "replicas" in pod.workload["spec"]:
            problems.append(f"{pod.name}: sets replicas while {ident(so)} owns them (each apply would reset them)")
        pre_stop = pod.container.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
        if pre_stop[:2] != ["kvmesh", "drain"]:
            problems.append(f"{pod.name}: no `kvmesh drain` preStop: scale-down would cut its streams")
    return problems


def _served_model(objects: list[Obj], pod: Pod) -> str | None:
    cfg, _ = mesh_config(objects, pod)
    return None if cfg is None else cfg.engine_config(0).model


def _selected_models(query: str, metric: str) -> set[str]:
    """The `model="..."` values the query's selectors of `metric` name."""
    import re

    return set(re.findall(rf'{re.escape(metric)}\s*{{[^}}]*\bmodel\s*=\s*"([^"]*)"', query))


def _check_trigger(so: Obj, trigger: dict[str, Any], exported: set[str], model: str | None) -> list[str]:
    from services.observability.promql import metric_names

    meta = trigger.get("metadata", {})
    where = f"{ident(so)} trigger {trigger.get('name', trigger['type'])}"
    if trigger["type"] != "prometheus":
        return [f"{where}: type {trigger['type']}, not prometheus (the scheduler's figure is a Prometheus series)"]
    query = meta.get("query", "")
    problems = [f"{where}: {name} is no series the scheduler exports"
                for name in sorted(metric_names(query) - exported)]
    if DESIRED_ENGINES not in metric_names(query):
        problems.append(f"{where}: the query does not read {DESIRED_ENGINES}")
    models = _selected_models(query, DESIRED_ENGINES)
    if model is not None and models != {model}:
        problems.append(f"{where}: selects model {sorted(models)}, the target's engines serve {model!r}")
    if trigger.get("metricType") != "AverageValue" or str(meta.get("threshold")) != "1":
        problems.append(f"{where}: metricType {trigger.get('metricType')} threshold {meta.get('threshold')}: "
                        "replicas are the figure only with AverageValue and threshold 1")
    return problems


def check_scaling_query(objects: list[Obj]) -> list[str]:
    from services.observability.metric_catalogue import exported_metric_names

    exported = exported_metric_names()["scheduler"]
    problems = []
    for so in scaled_objects(objects):
        pod = _target(objects, so)
        model = None if pod is None else _served_model(objects, pod)
        for trigger in so["spec"]["triggers"]:
            problems += _check_trigger(so, trigger, exported, model)
        low, high = so["spec"].get("minReplicaCount", 0), so["spec"].get("maxReplicaCount", 100)
        if low > high:
            problems.append(f"{ident(so)}: minReplicaCount {low} > maxReplicaCount {high}")
        problems += _check_bounds(objects, so, low, high)
    return problems


def _check_bounds(objects: list[Obj], so: Obj, low: int, high: int) -> list[str]:
    """The scheduler clamps its figure to the replicas' bounds, and treats
    the model as autoscaled (scale from zero: its requests wait while an
    engine starts)."""
    pod = pod_of(objects, "scheduler")
    cfg, problems = mesh_config(objects, pod)
    if cfg is None:
        return problems
    scaling = cfg.scheduler.scaling
    if not scaling.enabled:
        problems.append(f"{pod.name}: scheduler.scaling.enabled is off while {ident(so)} scales the engines "
                        "(a model with no engine would refuse requests instead of waiting for one)")
    if (scaling.min_engines, scaling.max_engines) != (low, high):
        problems.append(f"{pod.name}: scheduler.scaling bounds {scaling.min_engines}..{scaling.max_engines} "
                        f"differ from {ident(so)}'s replicas {low}..{high}")
    return problems


def _scrape_targets(objects: list[Obj], prom: Pod) -> list[str]:
    """`host:port` of what the Prometheus pod's config scrapes (DNS and static targets)."""
    flag = next((a.split("=", 1)[1] for a in prom.argv() if a.startswith("--config.file=")), "")
    folder, _, name = flag.rpartition("/")
    found = prom.volume(folder)
    if found is None or "configMap" not in found[1]:
        return []
    cm_name = found[1]["configMap"]["name"]
    cm = next((o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"] == cm_name), None)
    if cm is None or name not in cm.get("data", {}):
        return []
    out = []
    for job in yaml.safe_load(cm["data"][name]).get("scrape_configs", []):
        for sd in job.get("dns_sd_configs", []):
            out += [f"{n}:{sd.get('port')}" for n in sd.get("names", [])]
        for static in job.get("static_configs", []):
            out += list(static.get("targets", []))
    return out


def _check_scrapes_scheduler(objects: list[Obj], prom: Pod) -> list[str]:
    scheduler = pod_of(objects, "scheduler")
    metrics = listening_ports(objects, scheduler).get("metrics")
    targets = _scrape_targets(objects, prom)
    if not any(service_target(objects, t) == ("scheduler", metrics) for t in targets):
        return [f"{prom.name}: scrapes {targets}, not the scheduler replicas' metrics port {metrics}"]
    if metrics is not None and not policy_allows(objects, pod_labels(prom), namespace(objects), "scheduler", metrics):
        return [f"{prom.name}: the NetworkPolicies keep it from the schedulers' metrics port {metrics}"]
    return []


def check_prometheus_address(objects: list[Obj]) -> list[str]:
    problems = []
    for so in scaled_objects(objects):
        for trigger in (t for t in so["spec"]["triggers"] if t["type"] == "prometheus"):
            address = trigger["metadata"].get("serverAddress", "")
            url = urlsplit(address)
            target = service_target(objects, f"{url.hostname}:{url.port or 80}") if url.hostname else None
            if target is None or target[0] != "prometheus":
                problems.append(f"{ident(so)}: serverAddress {address} is no Service of the overlay "
                                "in front of a Prometheus pod")
                continue
            prom = pod_of(objects, "prometheus")
            if target[1] != listening_ports(objects, prom).get("http"):
                problems.append(f"{ident(so)}: serverAddress {address} reaches port {target[1]}, "
                                f"not the port {prom.name} listens on")
            problems += _check_scrapes_scheduler(objects, prom)
            if not policy_allows(objects, {}, KEDA_NAMESPACE, "prometheus", target[1]):
                problems.append(f"{prom.name}: the NetworkPolicies keep KEDA (namespace {KEDA_NAMESPACE}) "
                                f"from port {target[1]}")
    return problems


def check_scale_down(objects: list[Obj]) -> list[str]:
    problems = []
    for so in scaled_objects(objects):
        behavior = so["spec"].get("advanced", {}).get("horizontalPodAutoscalerConfig", {}).get("behavior", {})
        down = behavior.get("scaleDown", {})
        pod = _target(objects, so)
        grace = 30 if pod is None else int(pod.spec.get("terminationGracePeriodSeconds", 30))
        if down.get("selectPolicy") == "Disabled":
            continue
        window = down.get("stabilizationWindowSeconds", 300)
        if window < MIN_STABILIZATION_SECONDS:
            problems.append(f"{ident(so)}: scale-down stabilization {window} s, under {MIN_STABILIZATION_SECONDS} s")
        policies = down.get("policies") or [{"type": "Percent", "value": 100, "periodSeconds": 15}]  # HPA's default
        slow = [p for p in policies if p["type"] == "Pods" and p["value"] == 1 and p["periodSeconds"] >= grace]
        if not slow or (down.get("selectPolicy", "Max") != "Min" and len(slow) != len(policies)):
            problems.append(f"{ident(so)}: scale-down may take more than one pod per {grace} s "
                            f"(the target's terminationGracePeriodSeconds): {policies}, "
                            f"selectPolicy {down.get('selectPolicy', 'Max')}")
    return problems
