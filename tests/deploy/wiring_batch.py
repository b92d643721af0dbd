"""Cross-checks of the batch service's manifests (deploy/base/batch.yaml)
against its config and the rest of the mesh:

- check_batch_state: the Batch API is on; `kvmesh batch` is a StatefulSet of
  exactly one pod (one writer of one SQLite file) under a headless Service;
  `batch.database` lies on a writable volume of a volumeClaimTemplate (a
  PersistentVolumeClaim that outlives the pod), never an emptyDir or the
  read-only root filesystem;
- check_batch_credentials: `batch.internal_key_file` is a key of a Secret
  mounted in the batch pod and in every gateway pod (the gateways honour a
  line's batch headers only with it), and the users' API key file is
  mounted in the batch pod too;
- check_batch_path: `batch.gateway_url` is a Service port that reaches the
  gateways' or Envoy's HTTP listener and the NetworkPolicies let the batch
  pod reach it; Envoy's routes for /v1/files and /v1/batches go to a cluster
  whose endpoints are the batch Service's HTTP port, and the policies let
  Envoy reach that port.
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import urlsplit

from services.batch.submit import LINE_HEADERS
from services.common.config import MeshConfig
from services.edge.render import HTTP_CLUSTER

from .manifests import Obj
from .wiring import (
    Pod,
    _secret_files,
    envoy_bootstrap,
    find,
    listening_ports,
    mesh_config,
    pod_labels,
    pod_of,
    pods,
    policy_allows,
    service_target,
)

__all__ = ["BATCH_PATHS", "check_batch_credentials", "check_batch_path", "check_batch_state"]

# The paths Envoy must send to the batch service (its whole public API).
BATCH_PATHS = ("/v1/files", "/v1/batches")
# A header every line the batch service sends carries (Envoy sees names in lower case).
LINE_KEY_HEADER = LINE_HEADERS["key_id"].lower()


def _batch_pod(objects: list[Obj]) -> tuple[Pod, MeshConfig | None, list[str]]:
    """The batch pod, the mesh config it loads (None if it does not), problems."""
    pod = pod_of(objects, "batch")
    cfg, problems = mesh_config(objects, pod)
    return pod, cfg, problems


def _under(path: str, folder: str) -> bool:
    return PurePosixPath(folder) in PurePosixPath(path).parents


def check_batch_state(objects: list[Obj]) -> list[str]:
    pod, cfg, problems = _batch_pod(objects)
    if cfg is None:
        return problems
    if not cfg.batch.enabled:
        problems.append(f"{pod.name}: batch.enabled is false: /v1/files and /v1/batches would not be served")
    sts = pod.workload
    if sts["kind"] != "StatefulSet" or sts["spec"].get("replicas", 1) != 1:
        problems.append(f"{pod.name}: must be a StatefulSet of exactly 1 replica (one writer of its SQLite file)")
    svc = find(objects, "Service", sts["spec"].get("serviceName", ""))
    if svc is None or svc["spec"].get("clusterIP") != "None":
        problems.append(f"{pod.name}: its serviceName is no headless Service")
    claims = {t["metadata"]["name"]: t for t in sts["spec"].get("volumeClaimTemplates", [])}
    database = cfg.batch.database
    mount = next((m for m in pod.container.get("volumeMounts", []) if _under(database, m["mountPath"])), None)
    if not database or mount is None:
        problems.append(f"{pod.name}: batch.database {database!r} is on no mounted volume")
    elif mount["name"] not in claims:
        problems.append(f"{pod.name}: batch.database {database} is on volume {mount['name']}, not a "
                        "volumeClaimTemplate's claim (its data would not outlive the pod)")
    elif mount.get("readOnly") or "ReadWriteOnce" not in claims[mount["name"]]["spec"].get("accessModes", []):
        problems.append(f"{pod.name}: batch.database's claim {mount['name']} is not mounted writable (ReadWriteOnce)")
    return problems


def _has_file(pod: Pod, path: str) -> bool:
    files = _secret_files(pod, str(Path(path).parent))
    return files is not None and ("*" in files[1] or Path(path).name in files[1])


def check_batch_credentials(objects: list[Obj]) -> list[str]:
    pod, cfg, problems = _batch_pod(objects)
    if cfg is None:
        return problems
    key_file = cfg.batch.internal_key_file
    for p in (q for q in pods(objects) if q.component in ("batch", "gateway")):
        if not key_file or not _has_file(p, key_file):
            problems.append(f"{p.name}: batch.internal_key_file {key_file!r} is in no Secret mounted in the "
                            "container")
    if cfg.gateway.api_keys_file and not _has_file(pod, cfg.gateway.api_keys_file):
        problems.append(f"{pod.name}: gateway.api_keys_file {cfg.gateway.api_keys_file} (the users' keys) is in "
                        "no Secret mounted in the container")
    return problems


def _envoy_batch_clusters(objects: list[Obj], boot: dict[str, Any]) -> tuple[set[str], list[str]]:
    """Names of Envoy's clusters whose every endpoint is the batch Service's HTTP port."""
    want = ("batch", listening_ports(objects, pod_of(objects, "batch")).get("http"))
    names, problems = set(), []
    for cluster in boot["static_resources"]["clusters"]:
        targets = {service_target(objects, f"{ep['endpoint']['address']['socket_address']['address']}:"
                                           f"{ep['endpoint']['address']['socket_address']['port_value']}")
                   for group in cluster.get("load_assignment", {}).get("endpoints", [])
                   for ep in group.get("lb_endpoints", [])}
        if targets == {want}:
            names.add(cluster["name"])
    if not names:
        problems.append(f"Envoy has no cluster for the batch Service's HTTP port {want[1]}")
    return names, problems


def _route_cluster(boot: dict[str, Any], path: str, headers: dict[str, str]) -> str | None:
    """The cluster Envoy's public listener sends a request for `path` with
    `headers` (":method" among them) to: its first matching route, as Envoy."""
    for listener in boot["static_resources"]["listeners"]:
        if listener["name"] != "public":
            continue
        for chain in listener["filter_chains"]:
            for f in chain["filters"]:
                config = f.get("typed_config", {}).get("route_config", {})
                for vhost in config.get("virtual_hosts", []):
                    for route in vhost.get("routes", []):
                        if _route_matches(route["match"], path, headers):
                            return (route.get("route") or {}).get("cluster")
    return None


def _path_matches(match: dict[str, Any], path: str) -> bool:
    if "path" in match:
        return bool(match["path"] == path)
    if "prefix" in match:
        return path.startswith(match["prefix"])
    if "path_separated_prefix" in match:
        prefix = match["path_separated_prefix"]
        return path == prefix or path.startswith(prefix + "/")
    return False


def _header_matches(header: dict[str, Any], headers: dict[str, str]) -> bool:
    value = headers.get(header["name"])
    string_match = header.get("string_match", {})
    if value is None:
        return False
    if "exact" in string_match:
        return bool(value == string_match["exact"])
    if "prefix" in string_match:
        return value.startswith(string_match["prefix"])
    return bool(header.get("present_match"))


def _route_matches(match: dict[str, Any], path: str, headers: dict[str, str]) -> bool:
    return _path_matches(match, path) and all(_header_matches(h, headers) for h in match.get("headers", []))


def check_batch_path(objects: list[Obj]) -> list[str]:
    pod, cfg, problems = _batch_pod(objects)
    if cfg is None:
        return problems
    url = urlsplit(cfg.batch.gateway_url)
    target = service_target(objects, f"{url.hostname}:{url.port}") if url.hostname and url.port else None
    reachable = {("gateway", listening_ports(objects, pod_of(objects, "gateway")).get("http")),
                 ("envoy", listening_ports(objects, pod_of(objects, "envoy")).get("http"))}
    if target not in reachable:
        problems.append(f"{pod.name}: batch.gateway_url {cfg.batch.gateway_url!r} is not the gateways' nor Envoy's "
                        "HTTP Service port")
    elif not policy_allows(objects, pod_labels(pod), "kvmesh", target[0], target[1]):
        problems.append(f"{pod.name}: the NetworkPolicies keep it from {target[0]}:{target[1]} (batch.gateway_url)")
    envoy = pod_of(objects, "envoy")
    boot = envoy_bootstrap(objects, envoy)
    if boot is None:
        return [*problems, f"{envoy.name}: no bootstrap"]
    clusters, found = _envoy_batch_clusters(objects, boot)
    problems += found
    for path in BATCH_PATHS:
        for sub, method in (("", "POST"), ("", "GET"), ("/x-1", "GET")):
            got = _route_cluster(boot, path + sub, {":method": method, "content-type": "application/json"})
            if clusters and got not in clusters:
                problems.append(f"Envoy sends {method} {path}{sub} to {got!r}, not the batch Service")
    if target is not None and target[0] == "envoy":
        # The lines the batch service sends back through Envoy reach the gateways.
        line = {":method": "POST", "content-type": "application/json", LINE_KEY_HEADER: "0123456789ab"}
        for path in ("/v1/chat/completions", "/v1/completions"):
            if (got := _route_cluster(boot, path, line)) != HTTP_CLUSTER:
                problems.append(f"Envoy sends the batch service's lines ({path}) to {got!r}, not {HTTP_CLUSTER}")
    port = listening_ports(objects, pod).get("http", -1)
    if not policy_allows(objects, pod_labels(envoy), "kvmesh", "batch", port):
        problems.append(f"the NetworkPolicies keep Envoy from the batch pod's HTTP port {port}")
    return problems
