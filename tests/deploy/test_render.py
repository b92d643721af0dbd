"""Every overlay renders offline, holds the objects the contract names, and
validates against the Kubernetes schemas (0 errors)."""

from __future__ import annotations

import copy
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from .manifests import DEPLOY, K8S_VERSIONS, OVERLAYS, ROOT, Obj, kustomize, render, schema_errors
from .wiring import find, pod_of

CONTRACT = [
    ("Namespace", "kvmesh"), ("StatefulSet", "kvmesh-scheduler"), ("Service", "kvmesh-scheduler"),
    ("PodDisruptionBudget", "kvmesh-scheduler"),
    ("Deployment", "kvmesh-gateway"), ("Service", "kvmesh-gateway"),
    ("HorizontalPodAutoscaler", "kvmesh-gateway"), ("PodDisruptionBudget", "kvmesh-gateway"),
    ("StatefulSet", "kvmesh-engine"), ("Service", "kvmesh-engine"),
    ("StatefulSet", "kvmesh-batch"), ("Service", "kvmesh-batch"), ("NetworkPolicy", "kvmesh-batch-from-envoy"),
    ("Deployment", "kvmesh-envoy"), ("Service", "kvmesh-envoy"),
]


def _named(objects: list[Obj], kind: str, prefix: str) -> Obj | None:
    """A generated ConfigMap: its name carries kustomize's content hash."""
    return next((o for o in objects if o["kind"] == kind and re.fullmatch(rf"{prefix}(-[a-z0-9]+)?",
                                                                          o["metadata"]["name"])), None)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_renders_with_the_contract_objects(overlay: str) -> None:
    objects = render(overlay)
    for kind, name in CONTRACT:
        assert find(objects, kind, name) is not None, f"{overlay}: no {kind} {name}"
    for name in ("kvmesh-config", "kvmesh-envoy"):
        assert _named(objects, "ConfigMap", name) is not None, f"{overlay}: no ConfigMap {name}"
    assert {o["metadata"].get("namespace", "kvmesh") for o in objects} == {"kvmesh"}
    for obj in objects:
        if obj["kind"] not in ("Namespace", "PersistentVolume"):
            assert obj["metadata"]["labels"]["app.kubernetes.io/name"] == "kvmesh", obj["metadata"]["name"]
    # Active scheduler replicas, peers (tests/deploy/wiring_scheduler.py checks their wiring).
    scheduler = find(objects, "StatefulSet", "kvmesh-scheduler")
    assert scheduler is not None
    assert scheduler["spec"]["replicas"] >= 2 and scheduler["spec"]["podManagementPolicy"] == "Parallel"
    assert find(objects, "Service", "kvmesh-scheduler")["spec"]["clusterIP"] == "None"
    assert find(objects, "PodDisruptionBudget", "kvmesh-scheduler")["spec"]["minAvailable"] == 1
    assert find(objects, "Service", "kvmesh-envoy")["spec"]["type"] in ("LoadBalancer", "NodePort")


@pytest.mark.parametrize("overlay", OVERLAYS)
@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_object_validates(overlay: str, version: str) -> None:
    assert schema_errors(render(overlay), version) == []


def test_schema_check_catches_wrong_objects() -> None:
    objects = render("overlays/monitoring")
    sts = copy.deepcopy(find(objects, "StatefulSet", "kvmesh-engine"))
    sts["spec"]["template"]["spec"]["containers"][0]["startupProbe"]["httpGets"] = {}
    svc = copy.deepcopy(find(objects, "Service", "kvmesh-gateway"))
    svc["spec"]["ports"][0]["port"] = "eight thousand"
    monitor = copy.deepcopy(find(objects, "ServiceMonitor", "kvmesh"))
    monitor["spec"]["endpoints"][0]["intervall"] = "15s"
    rule = copy.deepcopy(find(objects, "PrometheusRule", "kvmesh"))
    del rule["spec"]["groups"][0]["rules"][0]["expr"]
    cert = copy.deepcopy(find(render("overlays/cert-manager"), "Certificate", "kvmesh-mesh-engine"))
    cert["spec"]["dnsName"] = cert["spec"].pop("dnsNames")
    errors = schema_errors([sts, svc, monitor, rule, cert], K8S_VERSIONS[0])  # type: ignore[list-item]  # rendered objects broken on purpose for the schema check
    assert len(errors) == 5, errors
    assert "httpGets" in errors[0] and "eight thousand" in errors[1] and "intervall" in errors[2]
    assert "expr" in errors[3] and "dnsName" in errors[4]


def test_dev_cpu_is_three_sim_engines_two_gateways_on_a_node_port() -> None:
    objects = render("overlays/dev-cpu")
    assert find(objects, "StatefulSet", "kvmesh-engine")["spec"]["replicas"] == 3
    assert find(objects, "Deployment", "kvmesh-gateway")["spec"]["replicas"] == 2
    assert find(objects, "Service", "kvmesh-envoy")["spec"]["type"] == "NodePort"
    config = yaml.safe_load(_named(objects, "ConfigMap", "kvmesh-config")["data"]["kvmesh.yaml"])
    assert config["engines"]["backend"] == "sim"
    pv = find(objects, "PersistentVolume", "kvmesh-models")
    assert pv is not None and pv["spec"]["hostPath"]["path"] == "/models"
    for pod in ("scheduler", "gateway", "engine"):
        assert pod_of(objects, pod).container["image"] == "kvmesh:cpu"


def test_gpu_runs_one_vllm_engine_per_gpu() -> None:
    objects = render("overlays/gpu")
    engine = pod_of(objects, "engine")
    resources = engine.container["resources"]
    assert resources["limits"]["nvidia.com/gpu"] == 1 and resources["requests"]["nvidia.com/gpu"] == 1
    assert engine.spec["nodeSelector"] and any(t["key"] == "nvidia.com/gpu" for t in engine.spec["tolerations"])
    assert engine.container["image"] == "kvmesh:gpu"
    config = yaml.safe_load(_named(objects, "ConfigMap", "kvmesh-config")["data"]["kvmesh.yaml"])
    assert config["engines"]["backend"] == "vllm"
    for name in ("scheduler", "gateway"):
        assert "nvidia.com/gpu" not in str(pod_of(objects, name).container["resources"])


def test_pods_run_unprivileged() -> None:
    for overlay in OVERLAYS:
        for obj in render(overlay):
            if obj["kind"] not in ("Deployment", "StatefulSet"):
                continue
            spec = obj["spec"]["template"]["spec"]
            assert spec["securityContext"]["runAsNonRoot"] is True and spec["securityContext"]["runAsUser"] == 10001
            assert spec["automountServiceAccountToken"] is False
            for c in spec["containers"]:
                sc = c["securityContext"]
                assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True
                assert sc["capabilities"]["drop"] == ["ALL"], (overlay, obj["metadata"]["name"])
            assert not any("hostPath" in v for v in spec.get("volumes", [])), "hostPath only through a PV"


def test_no_ip_address_and_no_key_in_deploy() -> None:
    """Services are found by DNS names only; keys are made by scripts/k8s_secrets.sh, never committed."""
    ip = re.compile(r"(?<![\d.])(\d{1,3}\.\d{1,3}\.\d{1,3}\.\d{1,3})(?![\d.])")
    for path in sorted(DEPLOY.rglob("*")):
        if path.suffix not in (".yaml", ".yml") or not path.is_file():
            continue
        text = path.read_text()
        assert "PRIVATE KEY" not in text, path
        found = set(ip.findall(text)) - {"0.0.0.0", "127.0.0.1"}
        assert not found, f"{path}: IP address {sorted(found)}"


def test_envoy_bootstrap_in_the_configmap_is_the_rendered_one() -> None:
    """deploy/base/envoy/envoy.yaml is a copy of envoy/rendered/envoy-kubernetes.yaml
    (`make render`; tests/unit/edge checks that rendering is current)."""
    copy_ = DEPLOY / "base" / "envoy" / "envoy.yaml"
    assert copy_.read_text() == (ROOT / "envoy" / "rendered" / "envoy-kubernetes.yaml").read_text()
    cm = _named(render("base"), "ConfigMap", "kvmesh-envoy")
    assert cm is not None and cm["data"]["envoy.yaml"] == copy_.read_text()
    assert "kvmesh.pb" in cm["binaryData"]


def test_a_broken_kustomization_fails_to_render(tmp_path: Path) -> None:
    work = tmp_path / "deploy"
    subprocess.run(["cp", "-r", str(DEPLOY), str(work)], check=True)
    (work / "base" / "kustomization.yaml").write_text(
        (work / "base" / "kustomization.yaml").read_text().replace("  - engine.yaml\n", "  - engines.yaml\n"))
    with pytest.raises(RuntimeError, match=r"engines\.yaml"):
        kustomize(work / "overlays" / "dev-cpu")


def test_the_scaledobject_schema_catches_wrong_fields() -> None:
    """KEDA's vendored schema (deploy/schemas/scaledobject-keda-v1alpha1.json) is strict."""
    so = copy.deepcopy(find(render("overlays/autoscaling"), "ScaledObject", "kvmesh-engine"))
    assert so is not None and schema_errors([so], K8S_VERSIONS[0]) == []
    so["spec"]["maxReplicas"] = so["spec"].pop("maxReplicaCount")  # the HPA's spelling, not KEDA's
    so["spec"]["triggers"][0]["metadata"]["threshold"] = 1  # metadata values are strings
    del so["spec"]["scaleTargetRef"]["name"]
    errors = schema_errors([so], K8S_VERSIONS[0])
    assert len(errors) == 1 and "ScaledObject/kvmesh-engine" in errors[0], errors
    so["spec"]["maxReplicaCount"] = so["spec"].pop("maxReplicas")
    so["spec"]["triggers"][0]["metadata"]["threshold"] = "1"
    assert "'name' is a required property" in schema_errors([so], K8S_VERSIONS[0])[0]
