"""The Kubernetes rules kube.py applies (no root, no namespaces): `$(VAR)`
expansion, label selectors, pod names, Service-link variables."""

from __future__ import annotations

import pytest

from .kube import Objects, expand, pods, selects, service_env

pytestmark = pytest.mark.unit  # no root, no namespaces: the fast tier (tests/conftest.py)

ENV = {"POD_NAME": "kvmesh-engine-1", "NS": "kvmesh"}


@pytest.mark.parametrize(("text", "want"), [
    ("$(POD_NAME).kvmesh-engine.$(NS).svc:50100", "kvmesh-engine-1.kvmesh-engine.kvmesh.svc:50100"),
    ("$$(POD_NAME)", "$(POD_NAME)"),          # escaped
    ("$(UNDEFINED)", "$(UNDEFINED)"),          # left as written
    ("$POD_NAME and $", "$POD_NAME and $"),    # not a reference
    ("$(POD_NAME", "$(POD_NAME"),              # unterminated
    ("a$$b", "a$b"),
])
def test_var_expansion_follows_kubernetes(text: str, want: str) -> None:
    assert expand(text, ENV) == want


def test_selectors() -> None:
    labels = {"app.kubernetes.io/name": "kvmesh", "app.kubernetes.io/component": "engine"}
    assert selects({}, labels)
    assert selects({"matchLabels": {"app.kubernetes.io/component": "engine"}}, labels)
    assert not selects({"matchLabels": {"app.kubernetes.io/component": "gateway"}}, labels)
    assert selects({"matchExpressions": [{"key": "app.kubernetes.io/component", "operator": "In",
                                          "values": ["engine", "gateway"]}]}, labels)
    assert not selects({"matchExpressions": [{"key": "tier", "operator": "Exists"}]}, labels)


def _workload(kind: str, name: str, replicas: int) -> dict:
    return {"kind": kind, "metadata": {"name": name}, "spec": {"replicas": replicas, "template": {
        "metadata": {"labels": {"app.kubernetes.io/component": name.rsplit("-", 1)[1]}},
        "spec": {"containers": [{"name": "c"}]}}}}


def test_pod_names_like_kubernetes() -> None:
    objects = Objects([_workload("StatefulSet", "kvmesh-engine", 3), _workload("Deployment", "kvmesh-gateway", 2)])
    names = [p.name for p in pods(objects)]
    assert sorted(n for n in names if "engine" in n) == [f"kvmesh-engine-{i}" for i in range(3)]
    gateways = [n for n in names if "gateway" in n]
    assert len(set(gateways)) == 2
    for n in gateways:  # <deployment>-<template hash>-<suffix>, one hash for the ReplicaSet
        assert n.startswith("kvmesh-gateway-") and len(n.split("-")) == 4
    assert len({n.split("-")[2] for n in gateways}) == 1


def test_service_links_for_cluster_ip_services_only() -> None:
    objects = Objects([
        {"kind": "Service", "metadata": {"name": "kvmesh-scheduler"},
         "spec": {"ports": [{"name": "grpc", "port": 50051}, {"name": "metrics", "port": 9101}]}},
        {"kind": "Service", "metadata": {"name": "kvmesh-engine"},
         "spec": {"clusterIP": "None", "ports": [{"name": "grpc", "port": 50100}]}},
    ])
    env = service_env(objects, {"kvmesh-scheduler": "198.18.1.5", "kvmesh-engine": "198.18.1.6"})
    assert env["KVMESH_SCHEDULER_SERVICE_HOST"] == "198.18.1.5"
    assert env["KVMESH_SCHEDULER_SERVICE_PORT"] == "50051"
    assert env["KVMESH_SCHEDULER_SERVICE_PORT_METRICS"] == "9101"
    assert env["KVMESH_SCHEDULER_PORT"] == "tcp://198.18.1.5:50051"
    assert env["KVMESH_SCHEDULER_PORT_9101_TCP_ADDR"] == "198.18.1.5"
    assert not any(k.startswith("KVMESH_ENGINE_") for k in env)  # headless: none


def test_volume_claim_templates_give_each_pod_its_own_claim() -> None:
    """A StatefulSet's volumeClaimTemplates: claim `<template>-<pod>`, mounted
    where the container says, the same for every start of that pod."""
    sts = _workload("StatefulSet", "kvmesh-batch", 2)
    sts["spec"]["volumeClaimTemplates"] = [{"metadata": {"name": "state"}, "spec": {"accessModes": ["ReadWriteOnce"]}}]
    sts["spec"]["template"]["spec"]["containers"][0]["volumeMounts"] = [{"name": "state", "mountPath": "/var/lib/x"}]
    objects = Objects([sts])
    found = pods(objects)
    assert [p.claims for p in found] == [{"state": "state-kvmesh-batch-0"}, {"state": "state-kvmesh-batch-1"}]
    volumes = found[1].container(objects, "198.18.1.9", {}).volumes
    assert [(v.path, v.claim, v.read_only) for v in volumes] == [("/var/lib/x", "state-kvmesh-batch-1", False)]
