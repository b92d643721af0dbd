"""deploy/overlays/tracing: dev-cpu with every service's and Envoy's spans
posted to an OpenTelemetry Collector in the namespace `monitoring`. Its two
files are copies with one block added, checked here so they cannot drift
from dev-cpu's config and the Kubernetes Envoy topology."""

from __future__ import annotations

import copy
import dataclasses

import yaml

from services.common.config import load_config
from services.edge.render import ENVOY_DIR
from services.edge.topology import load_topology
from services.edge.tracing import TracingSpec, spec_from_config

from .manifests import DEPLOY, Obj, render
from .wiring_monitoring import check_tracing

OVERLAY = DEPLOY / "overlays" / "tracing"
COLLECTOR = "http://otel-collector.monitoring.svc.cluster.local:4318"


def test_the_config_is_dev_cpus_plus_tracing() -> None:
    ours = yaml.safe_load((OVERLAY / "kvmesh.yaml").read_text())
    dev_cpu = yaml.safe_load((DEPLOY / "overlays" / "dev-cpu" / "kvmesh.yaml").read_text())
    assert ours.pop("tracing") == {"otlp_endpoint": COLLECTOR, "service_name": "kvmesh", "sample_ratio": 1.0}
    assert "tracing" not in dev_cpu and ours == dev_cpu
    assert load_config(OVERLAY / "kvmesh.yaml").tracing.enabled


def test_envoys_topology_is_kubernetes_plus_the_same_receiver() -> None:
    tracing = load_topology(ENVOY_DIR / "topology-kubernetes-tracing.yaml")
    plain = load_topology(ENVOY_DIR / "topology-kubernetes.yaml")
    assert dataclasses.replace(tracing, tracing=TracingSpec()) == plain
    assert tracing.tracing == spec_from_config(load_config(OVERLAY / "kvmesh.yaml").tracing)
    assert tracing.tracing.traces_url == f"{COLLECTOR}/v1/traces"


def test_the_overlay_runs_the_tracing_configs() -> None:
    objects = render("overlays/tracing")
    assert check_tracing(objects) == []
    envoy = next(o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"].startswith("kvmesh-envoy"))
    assert envoy["data"]["envoy.yaml"] == (OVERLAY / "envoy.yaml").read_text()
    assert "kvmesh.pb" in envoy["binaryData"]
    assert check_tracing(render("overlays/dev-cpu")) == []   # off on both sides


def _broken(change: str) -> list[Obj]:
    objects = copy.deepcopy(render("overlays/tracing"))
    for obj in objects:
        if obj["kind"] != "ConfigMap":
            continue
        name = obj["metadata"]["name"]
        if change == "envoy-url" and name.startswith("kvmesh-envoy"):
            obj["data"]["envoy.yaml"] = obj["data"]["envoy.yaml"].replace("otel-collector.monitoring", "otel.other")
        if change == "services-off" and name.startswith("kvmesh-config"):
            obj["data"]["kvmesh.yaml"] = obj["data"]["kvmesh.yaml"].replace(f"otlp_endpoint: {COLLECTOR}",
                                                                            'otlp_endpoint: ""')
    if change == "egress":
        objects.append({"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
                        "metadata": {"name": "deny-egress", "namespace": "kvmesh"},
                        "spec": {"podSelector": {}, "policyTypes": ["Egress"]}})
    return objects


def test_a_drifting_tracing_setup_fails() -> None:
    assert any("Envoy traces as" in p for p in check_tracing(_broken("envoy-url")))
    assert any("services do not" in p for p in check_tracing(_broken("services-off")))
    assert any("restricts egress" in p for p in check_tracing(_broken("egress")))
