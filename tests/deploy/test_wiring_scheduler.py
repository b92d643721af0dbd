"""The scheduler replicas' wiring (wiring_scheduler.py) in every overlay, and
each check failing on a manifest broken the way it guards against."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from .breaking import broken, config_edit
from .manifests import OVERLAYS, Obj, render
from .wiring import find, pod_of, pods
from .wiring_scheduler import check_scheduler_disruption, check_scheduler_replicas, scheduler_addresses_of

REPLICA_1 = "kvmesh-scheduler-1.kvmesh-scheduler:50051"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_gateway_engine_and_scheduler_dials_every_scheduler_pod(overlay: str) -> None:
    """Each client's addresses are the StatefulSet's pods, in order, by their
    names under the headless Service (a scheduler's: its peers, itself
    included); the PDB keeps one of at least two."""
    objects = render(overlay)
    sts = find(objects, "StatefulSet", "kvmesh-scheduler")
    assert sts is not None and sts["spec"]["serviceName"] == "kvmesh-scheduler"
    replicas = sts["spec"]["replicas"]
    assert replicas >= 2
    want = [f"kvmesh-scheduler-{i}.kvmesh-scheduler:50051" for i in range(replicas)]
    clients = [p for p in pods(objects) if p.component in ("gateway", "engine", "scheduler")]
    assert {p.component for p in clients} == {"gateway", "engine", "scheduler"}
    for pod in clients:
        assert scheduler_addresses_of(objects, pod) == want, (overlay, pod.name)
    assert check_scheduler_replicas(objects) == [] and check_scheduler_disruption(objects) == []


def _engine_list_only(old: str, new: str) -> Callable[[list[Obj]], None]:
    """Edit only the engines' list (the first occurrence: engines come before gateway in kvmesh.yaml)."""
    def change(objects: list[Obj]) -> None:
        cm = next(o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"].startswith("kvmesh-config"))
        assert old in cm["data"]["kvmesh.yaml"]
        cm["data"]["kvmesh.yaml"] = cm["data"]["kvmesh.yaml"].replace(old, new, 1)
    return change


def test_addresses_not_naming_every_pod_once_fail() -> None:
    left_out = check_scheduler_replicas(broken(_engine_list_only(f"      - {REPLICA_1}\n", "")))
    assert any("kvmesh-engine" in p and "leave out kvmesh-scheduler-1" in p for p in left_out), left_out
    assert not any("kvmesh-gateway" in p for p in left_out), "only the engines' list was edited"
    problems = check_scheduler_replicas(broken(config_edit(REPLICA_1, "kvmesh-scheduler-1.kvmesh-schedulers:50051")))
    assert any("is no pod of StatefulSet/kvmesh-scheduler" in p for p in problems), problems
    problems = check_scheduler_replicas(broken(config_edit(REPLICA_1, "kvmesh-scheduler-2.kvmesh-scheduler:50051")))
    assert any("kvmesh-scheduler-2.kvmesh-scheduler:50051 is no pod" in p for p in problems), problems
    problems = check_scheduler_replicas(broken(config_edit(REPLICA_1, "kvmesh-scheduler-1.kvmesh-scheduler:50052")))
    assert any("not the scheduler's gRPC port 50051" in p for p in problems), problems
    # The same pod by two spellings: a second stream to one replica, none to the other.
    twice = check_scheduler_replicas(broken(config_edit(REPLICA_1, "kvmesh-scheduler-0.kvmesh-scheduler.kvmesh:50051")))
    assert any("name kvmesh-scheduler-0 twice" in p for p in twice) and any("leave out" in p for p in twice), twice
    # One more replica, its name in no list.
    problems = check_scheduler_replicas(broken(
        lambda o: find(o, "StatefulSet", "kvmesh-scheduler")["spec"].__setitem__("replicas", 3)))
    assert any("leave out kvmesh-scheduler-2" in p for p in problems), problems
    # A fully qualified name is the same pod.
    fqdn = config_edit(REPLICA_1, "kvmesh-scheduler-1.kvmesh-scheduler.kvmesh.svc.cluster.local:50051")
    assert check_scheduler_replicas(broken(fqdn)) == []


def test_a_scheduler_without_stable_names_fails() -> None:
    def not_headless(objects: list[Obj]) -> None:
        find(objects, "Service", "kvmesh-scheduler")["spec"].pop("clusterIP")
    assert any("not headless" in p for p in check_scheduler_replicas(broken(not_headless)))

    def deployment(objects: list[Obj]) -> None:
        find(objects, "StatefulSet", "kvmesh-scheduler")["kind"] = "Deployment"
    assert any("must be a StatefulSet" in p for p in check_scheduler_replicas(broken(deployment)))

    def ordered_single(objects: list[Obj]) -> None:
        spec = find(objects, "StatefulSet", "kvmesh-scheduler")["spec"]
        spec.update(replicas=1, podManagementPolicy="OrderedReady")
    problems = check_scheduler_replicas(broken(ordered_single))
    assert any("fewer than 2" in p for p in problems) and any("Parallel" in p for p in problems), problems
    problems = check_scheduler_replicas(broken(
        lambda o: find(o, "StatefulSet", "kvmesh-scheduler")["spec"].__setitem__("serviceName", "kvmesh-sched")))
    assert any("serviceName 'kvmesh-sched' is no Service" in p for p in problems), problems


def test_schedulers_that_do_not_hear_each_other_fail() -> None:
    """Without the peers list (or with the replicas kept apart by a policy) a
    replica fills room another replica's more urgent request waits for."""
    def no_peers(objects: list[Obj]) -> None:
        cm = next(o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"].startswith("kvmesh-config"))
        text = cm["data"]["kvmesh.yaml"]
        start = text.index("  peers:\n")
        end = text.index("\n\n", start)
        cm["data"]["kvmesh.yaml"] = text[:start] + text[end + 1:]
    problems = check_scheduler_replicas(broken(no_peers))
    assert any("kvmesh-scheduler" in p and "leave out kvmesh-scheduler-0, kvmesh-scheduler-1" in p
               for p in problems), problems

    def no_scheduler_peers(objects: list[Obj]) -> None:
        policy = find(objects, "NetworkPolicy", "kvmesh-scheduler-from-mesh")
        assert policy is not None
        peers = policy["spec"]["ingress"][0]["from"]
        peers[:] = [p for p in peers if p["podSelector"]["matchLabels"]["app.kubernetes.io/component"] != "scheduler"]
    problems = check_scheduler_replicas(broken(no_scheduler_peers))
    assert any("kvmesh-scheduler" in p and "keep it from the schedulers' port 50051" in p
               for p in problems), problems


def test_a_policy_keeping_engines_from_the_schedulers_fails() -> None:
    def gateways_only(objects: list[Obj]) -> None:
        policy = find(objects, "NetworkPolicy", "kvmesh-scheduler-from-mesh")
        assert policy is not None
        peers = policy["spec"]["ingress"][0]["from"]
        peers[:] = [p for p in peers if p["podSelector"]["matchLabels"]["app.kubernetes.io/component"] != "engine"]
    problems = check_scheduler_replicas(broken(gateways_only))
    assert any("kvmesh-engine" in p and "keep it from the schedulers' port 50051" in p for p in problems), problems


def test_a_wrong_disruption_budget_or_hard_spreading_fails() -> None:
    def no_pdb(objects: list[Obj]) -> None:
        objects.remove(find(objects, "PodDisruptionBudget", "kvmesh-scheduler"))  # type: ignore[arg-type]  # find returns the object it found, typed loosely
    assert any("0 PodDisruptionBudgets" in p for p in check_scheduler_disruption(broken(no_pdb)))

    def keep_both(objects: list[Obj]) -> None:
        find(objects, "PodDisruptionBudget", "kvmesh-scheduler")["spec"]["minAvailable"] = 2
    assert any("minAvailable 2" in p for p in check_scheduler_disruption(broken(keep_both)))

    def every_pod(objects: list[Obj]) -> None:
        pdb = find(objects, "PodDisruptionBudget", "kvmesh-scheduler")
        assert pdb is not None
        pdb["spec"]["selector"] = {"matchLabels": {"app.kubernetes.io/name": "kvmesh"}}
    problems = check_scheduler_disruption(broken(every_pod))
    assert any("also selects Deployment/kvmesh-gateway" in p for p in problems), problems

    def hard(objects: list[Obj]) -> None:
        spec = pod_of(objects, "scheduler").spec
        anti = spec["affinity"]["podAntiAffinity"]
        anti["requiredDuringSchedulingIgnoredDuringExecution"] = [
            t["podAffinityTerm"] for t in anti.pop("preferredDuringSchedulingIgnoredDuringExecution")]
        spec["topologySpreadConstraints"][0]["whenUnsatisfiable"] = "DoNotSchedule"
    problems = check_scheduler_disruption(broken(hard))
    assert any("required pod anti-affinity" in p for p in problems), problems
    assert any("DoNotSchedule" in p for p in problems), problems
    assert any("across nodes" in p for p in problems), problems  # the preferred term by node is gone too
