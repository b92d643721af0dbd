"""Cross-checks of the scheduler replicas (README "Several schedulers",
deploy/base/scheduler.yaml):

- check_scheduler_replicas: the scheduler is a StatefulSet of at least
  `MIN_REPLICAS` peers (podManagementPolicy Parallel) under a headless
  governing Service that selects its pods; every gateway's and engine's
  scheduler addresses (the config's `schedulers()`, what the code dials) are
  exactly that StatefulSet's pods by their names under the Service, each pod
  once, on the port the scheduler serves gRPC on; the NetworkPolicies let
  every gateway and engine reach each of them there. A pod left out would
  get no engine reports (engines connect only to the listed replicas) and
  no requests; a name of no pod is a replica that never answers.
- check_scheduler_disruption: a PodDisruptionBudget selects the scheduler
  pods and keeps at least one, fewer than the replicas (a node drain can
  proceed); spreading across nodes is soft (preferred anti-affinity,
  ScheduleAnyway), so a one-node cluster still runs every replica.
"""

from __future__ import annotations

import re
from typing import Any

from .manifests import Obj, ident
from .wiring import (
    Pod,
    _matches,
    listening_ports,
    mesh_config,
    namespace,
    pod_args,
    pod_labels,
    pod_of,
    pods,
    policy_allows,
)

__all__ = ["MIN_REPLICAS", "check_scheduler_disruption", "check_scheduler_replicas", "scheduler_addresses_of"]

# Two replicas at least: with one, the PDB (minAvailable 1) blocks every
# drain and a restart stops admissions.
MIN_REPLICAS = 2
# Every component that dials the scheduler replicas: gateways (Admit), engines
# (Connect) and the replicas themselves (each other's queue heads, scheduler.peers).
_CLIENTS = ("gateway", "engine", "scheduler")


def scheduler_addresses_of(objects: list[Obj], pod: Pod) -> list[str]:
    """The scheduler replicas a gateway or engine pod dials, as its config
    and command line make them ([] when its config does not load)."""
    cfg, _ = mesh_config(objects, pod)
    if cfg is None:
        return []
    if pod.component == "gateway":
        return cfg.gateway.schedulers()
    if pod.component == "scheduler":
        return list(cfg.scheduler.peers.addresses)
    ns, _ = pod_args(pod)
    return cfg.engine_config(ns.index if ns is not None else 0).schedulers()


def _governing_service(objects: list[Obj], sts: Obj) -> tuple[Obj | None, list[str]]:
    name = sts["spec"].get("serviceName", "")
    svc = next((o for o in objects if o["kind"] == "Service" and o["metadata"]["name"] == name), None)
    if svc is None:
        return None, [f"{ident(sts)}: serviceName {name!r} is no Service"]
    problems = []
    if svc["spec"].get("clusterIP") != "None":
        problems.append(f"{ident(svc)}: not headless (clusterIP: None): pods get no names under it")
    if not _matches({"matchLabels": svc["spec"].get("selector", {})}, sts["spec"]["template"]["metadata"]["labels"]):
        problems.append(f"{ident(svc)}: its selector does not select the {ident(sts)} pods")
    return svc, problems


def _ordinal(address: str, sts: str, svc: str, ns: str) -> int | None:
    """The pod ordinal `address` names: `<sts>-<i>.<svc>[.<ns>[.svc[.cluster.local]]]:<port>`."""
    host = address.rpartition(":")[0]
    match = re.fullmatch(rf"{re.escape(sts)}-(\d+)\.{re.escape(svc)}(\..+)?", host)
    if match is None or (match.group(2) or "") not in ("", f".{ns}", f".{ns}.svc", f".{ns}.svc.cluster.local"):
        return None
    return int(match.group(1))


def _check_addresses(objects: list[Obj], sts: Obj, svc: Obj, grpc: int | None) -> list[str]:
    replicas = int(sts["spec"].get("replicas", 1))
    ns, name = namespace(objects), sts["metadata"]["name"]
    problems = []
    for pod in (p for p in pods(objects) if p.component in _CLIENTS):
        addresses = scheduler_addresses_of(objects, pod)
        seen: list[int] = []
        for address in addresses:
            ordinal = _ordinal(address, name, svc["metadata"]["name"], ns)
            port = address.rpartition(":")[2]
            if ordinal is None or ordinal >= replicas:
                problems.append(f"{pod.name}: scheduler address {address} is no pod of {ident(sts)} "
                                f"({name}-0 .. {name}-{replicas - 1}) under its Service {svc['metadata']['name']}")
            elif not port.isdigit() or int(port) != grpc:
                problems.append(f"{pod.name}: scheduler address {address} is not the scheduler's gRPC port {grpc}")
            else:
                seen.append(ordinal)
        missing = sorted(set(range(replicas)) - set(seen))
        if missing:
            problems.append(f"{pod.name}: its scheduler addresses {addresses} leave out "
                            f"{', '.join(f'{name}-{i}' for i in missing)}")
        twice = sorted({i for i in seen if seen.count(i) > 1})
        if twice:
            problems.append(f"{pod.name}: scheduler addresses name {', '.join(f'{name}-{i}' for i in twice)} twice")
        if grpc is not None and not policy_allows(objects, pod_labels(pod), ns, "scheduler", grpc):
            problems.append(f"{pod.name}: the NetworkPolicies keep it from the schedulers' port {grpc}")
    return problems


def check_scheduler_replicas(objects: list[Obj]) -> list[str]:
    pod = pod_of(objects, "scheduler")
    sts = pod.workload
    if sts["kind"] != "StatefulSet":
        return [f"{pod.name}: the scheduler must be a StatefulSet (stable names under a headless Service)"]
    problems = []
    if int(sts["spec"].get("replicas", 1)) < MIN_REPLICAS:
        problems.append(f"{pod.name}: replicas {sts['spec'].get('replicas', 1)}, fewer than {MIN_REPLICAS}")
    if sts["spec"].get("podManagementPolicy") != "Parallel":
        problems.append(f"{pod.name}: podManagementPolicy is not Parallel (the replicas are peers)")
    svc, found = _governing_service(objects, sts)
    problems += found
    if svc is not None:
        problems += _check_addresses(objects, sts, svc, listening_ports(objects, pod).get("grpc"))
    return problems


def _soft_spread(spec: dict[str, Any]) -> list[str]:
    """Problems with the pod's spreading: none at all, or a hard rule."""
    anti = spec.get("affinity", {}).get("podAntiAffinity", {})
    spread = spec.get("topologySpreadConstraints", [])
    problems = []
    if anti.get("requiredDuringSchedulingIgnoredDuringExecution"):
        problems.append("required pod anti-affinity (a one-node cluster could not run every replica)")
    if any(c.get("whenUnsatisfiable") == "DoNotSchedule" for c in spread):
        problems.append("a DoNotSchedule spread constraint (a one-node cluster could not run every replica)")
    preferred = anti.get("preferredDuringSchedulingIgnoredDuringExecution", [])
    by_node = [t["podAffinityTerm"]["topologyKey"] for t in preferred]
    by_node += [c["topologyKey"] for c in spread]
    if "kubernetes.io/hostname" not in by_node:
        problems.append("no preference to spread the replicas across nodes (kubernetes.io/hostname)")
    return problems


def check_scheduler_disruption(objects: list[Obj]) -> list[str]:
    pod = pod_of(objects, "scheduler")
    labels, replicas = pod_labels(pod), int(pod.workload["spec"].get("replicas", 1))
    budgets = [o for o in objects if o["kind"] == "PodDisruptionBudget" and _matches(o["spec"]["selector"], labels)]
    problems = [f"{pod.name}: {p}" for p in _soft_spread(pod.spec)]
    if len(budgets) != 1:
        return [*problems, f"{pod.name}: {len(budgets)} PodDisruptionBudgets select its pods, not 1"]
    spec = budgets[0]["spec"]
    keep = spec.get("minAvailable")
    if not isinstance(keep, int) or not 1 <= keep < replicas:
        problems.append(f"{ident(budgets[0])}: minAvailable {keep!r} is not within 1 .. replicas - 1 ({replicas - 1}):"
                        " a drain must keep one scheduler and still be able to evict one")
    for other in (p for p in pods(objects) if p.component != "scheduler"):
        if _matches(spec["selector"], pod_labels(other)):
            problems.append(f"{ident(budgets[0])}: also selects {other.name}")
    return problems
