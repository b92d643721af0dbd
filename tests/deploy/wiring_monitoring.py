"""Cross-checks of what Prometheus scrapes and what the operator tools need:

- check_scraped: every component's metrics port (Envoy: its stats-only
  listener) is reachable from the namespace `monitoring` by the
  NetworkPolicies and, where the overlay has Prometheus Operator monitors,
  scraped by one of them on that port and the right path;
- check_envoy_stats: Envoy's stats listener routes only GET
  /stats/prometheus, to a cluster that is the loopback admin interface;
- check_admin_keys: the scheduler's `scheduler.admin_keys_file` is a key of
  a Secret mounted in its container;
- check_tracing: Envoy traces exactly when the mesh config does, to the same
  receiver as the services, and no NetworkPolicy restricts egress to it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from services.edge.stats import STATS_PATH
from services.edge.tracing import COLLECTOR_CLUSTER, spec_from_config

from .manifests import Obj, ident
from .wiring import (
    COMPONENTS,
    Pod,
    _matches,
    _secret_files,
    envoy_bootstrap,
    listening_ports,
    mesh_config,
    pod_of,
    policy_allows,
    resolve_port,
    selected_pod,
)

MONITORING = ({"app.kubernetes.io/name": "prometheus"}, "monitoring")


def _path(component: str) -> str:
    return STATS_PATH if component == "envoy" else "/metrics"


def _labels(pod: Pod) -> dict[str, str]:
    return dict(pod.workload["spec"]["template"]["metadata"]["labels"])


def scrapes(objects: list[Obj], pod: Pod) -> list[tuple[str, int, str]]:
    """(monitor, container port, path) of every monitor endpoint scraping `pod`."""
    out = []
    for mon in (o for o in objects if o["kind"] == "PodMonitor"):
        if _matches(mon["spec"]["selector"], _labels(pod)):
            for ep in mon["spec"].get("podMetricsEndpoints", []):
                port = ep.get("port", ep.get("targetPort", -1))
                out.append((ident(mon), resolve_port(pod, port), ep.get("path", "/metrics")))
    services = [s for s in objects if s["kind"] == "Service"
                and getattr(selected_pod(objects, s), "name", None) == pod.name]
    for mon in (o for o in objects if o["kind"] == "ServiceMonitor"):
        for svc in services:
            if not _matches(mon["spec"]["selector"], svc["metadata"].get("labels", {})):
                continue
            for ep in mon["spec"].get("endpoints", []):
                sp = next((p for p in svc["spec"]["ports"] if p.get("name") == ep.get("port")), None)
                if sp is not None:
                    port = resolve_port(pod, sp.get("targetPort", sp["port"]))
                    out.append((f"{ident(mon)} via {ident(svc)}", port, ep.get("path", "/metrics")))
    return out


def check_scraped(objects: list[Obj]) -> list[str]:
    monitored = any(o["kind"] in ("PodMonitor", "ServiceMonitor") for o in objects)
    problems = []
    for component in COMPONENTS:
        pod = pod_of(objects, component)
        port = listening_ports(objects, pod).get("metrics")
        if port is None:
            problems.append(f"{pod.name}: no metrics port (Envoy: no stats listener) for Prometheus")
            continue
        if not policy_allows(objects, MONITORING[0], MONITORING[1], component, port):
            problems.append(f"{pod.name}: the NetworkPolicies keep the namespace monitoring from port {port}")
        if not monitored:
            continue
        found = scrapes(objects, pod)
        if not any(p == port and path == _path(component) for _, p, path in found):
            problems.append(f"{pod.name}: no monitor scrapes {_path(component)} on port {port} (found {found})")
        for name, p, path in found:
            if p != port or path != _path(component):
                problems.append(f"{pod.name}: {name} scrapes {path} on {p}, not {_path(component)} on {port}")
    return problems


def _stats_listener(boot: dict[str, Any]) -> dict[str, Any] | None:
    for listener in boot["static_resources"]["listeners"]:
        if listener["name"] == "stats":
            chain = listener["filter_chains"][0]["filters"][0]["typed_config"]
            return dict(chain)
    return None


def check_envoy_stats(objects: list[Obj]) -> list[str]:
    pod = pod_of(objects, "envoy")
    boot = envoy_bootstrap(objects, pod)
    manager = None if boot is None else _stats_listener(boot)
    if boot is None or manager is None:
        return [f"{pod.name}: Envoy has no stats listener"]
    admin = boot["admin"]["address"]["socket_address"]
    problems = []
    if admin["address"] != "127.0.0.1":
        problems.append(f"{pod.name}: Envoy's admin interface listens on {admin['address']}, not loopback")
    clusters = {c["name"]: c for c in boot["static_resources"]["clusters"]}
    for host in manager["route_config"]["virtual_hosts"]:
        for route in host["routes"]:
            if "direct_response" in route:
                continue
            match = route["match"]
            methods = [h.get("string_match", {}).get("exact") for h in match.get("headers", [])
                       if h["name"] == ":method"]
            if match.get("path") != STATS_PATH or methods != ["GET"]:
                problems.append(f"{pod.name}: the stats listener forwards {match} (only GET {STATS_PATH} may go)")
            cluster = clusters.get(route["route"]["cluster"], {})
            eps = [e["endpoint"]["address"]["socket_address"] for g in cluster.get("load_assignment", {}).get(
                "endpoints", []) for e in g["lb_endpoints"]]
            if eps != [admin]:
                problems.append(f"{pod.name}: the stats route's cluster {cluster.get('name')} is not the admin address")
    if not manager.get("normalize_path"):
        problems.append(f"{pod.name}: the stats listener matches unnormalised paths (/stats/prometheus/../x)")
    return problems


def check_admin_keys(objects: list[Obj]) -> list[str]:
    """The Admin service is on: its key file is a mounted Secret's key."""
    pod = pod_of(objects, "scheduler")
    cfg, problems = mesh_config(objects, pod)
    if cfg is None:
        return problems
    path = cfg.scheduler.admin_keys_file
    if not path or cfg.scheduler.admin_keys:
        return [f"{pod.name}: scheduler.admin_keys_file is unset (or keys are in the ConfigMap): the Admin "
                "service is off, or its key hashes are not in a Secret"]
    files = _secret_files(pod, str(Path(path).parent))
    if files is None or ("*" not in files[1] and Path(path).name not in files[1]):
        return [f"{pod.name}: scheduler.admin_keys_file {path} is in no Secret mounted in the container"]
    return []


def _envoy_tracing(boot: dict[str, Any]) -> dict[str, Any] | None:
    for listener in boot["static_resources"]["listeners"]:
        if listener["name"] == "public":
            manager = listener["filter_chains"][0]["filters"][0]["typed_config"]
            return manager.get("tracing")
    return None


def check_tracing(objects: list[Obj]) -> list[str]:
    pod = pod_of(objects, "envoy")
    boot = envoy_bootstrap(objects, pod)
    cfg, problems = mesh_config(objects, pod_of(objects, "gateway"))
    if boot is None or cfg is None:
        return problems or [f"{pod.name}: no Envoy bootstrap"]
    tracing = _envoy_tracing(boot)
    want = spec_from_config(cfg.tracing)
    if tracing is None:
        return [f"{pod.name}: the services trace to {cfg.tracing.otlp_endpoint} but Envoy does not"] \
            if want.enabled else []
    if not want.enabled:
        return [f"{pod.name}: Envoy traces but the services do not (tracing.otlp_endpoint is empty)"]
    provider = tracing["provider"]["typed_config"]
    got = (provider["http_service"]["http_uri"]["uri"], provider["service_name"], tracing["random_sampling"]["value"])
    if got != (want.traces_url, want.service_name, want.sampling_percent):
        problems.append(f"{pod.name}: Envoy traces as {got}, the mesh config says "
                        f"{(want.traces_url, want.service_name, want.sampling_percent)}")
    if COLLECTOR_CLUSTER not in {c["name"] for c in boot["static_resources"]["clusters"]}:
        problems.append(f"{pod.name}: no {COLLECTOR_CLUSTER} cluster for the tracer")
    for policy in (o for o in objects if o["kind"] == "NetworkPolicy"):
        if "Egress" in policy["spec"].get("policyTypes", []):
            problems.append(f"{ident(policy)} restricts egress: allow the trace receiver {want.traces_url}")
    return problems
