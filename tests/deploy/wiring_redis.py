"""Cross-checks of the shared Redis (deploy/base/redis.yaml) against the
mesh config and the NetworkPolicies:

- check_shared_state: every gateway keeps its Responses store in Redis
  (`responses.store: redis`: several gateway pods behind Envoy, so an
  embedded store would answer 404 to a continuation that lands on another
  pod), and `gateway.response_cache.redis_url` -- with the cache's own store
  and `scheduler.incarnations_redis_url` -- names the Redis Service's port;
- check_redis_access: the NetworkPolicies let exactly the components that
  use Redis (gateways, the scheduler) reach its port: not Envoy, engines,
  the batch service, the namespace `monitoring`, other namespaces nor a
  client outside the cluster (Redis has no password);
- check_redis_bounded: the official image pinned by a full version tag;
  `--maxmemory` set below the container's memory limit (with room for
  fragmentation and buffers) and above the largest Responses entry; the
  eviction policy one of `volatile-*` (entries with a TTL go, the
  scheduler's incarnation hash, which has none, stays).
"""

from __future__ import annotations

import re
from urllib.parse import urlsplit

from services.common.config import MeshConfig

from .manifests import Obj
from .wiring import Pod, listening_ports, mesh_config, namespace, pod_labels, pods, policy_allows, service_target

__all__ = ["REDIS_USERS", "check_redis_access", "check_redis_bounded", "check_shared_state", "redis_pod"]

# The components that talk to Redis, and so the only ones its policy admits.
REDIS_USERS = ("gateway", "scheduler")
# --maxmemory at most this share of the memory limit: no fork for a snapshot
# (no copy-on-write), but jemalloc's fragmentation and client buffers.
MAXMEMORY_SHARE = 0.75
_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1024, "m": 1000**2, "mb": 1024**2, "g": 1000**3, "gb": 1024**3}
_QUANTITY = {"": 1, "Ki": 1024, "Mi": 1024**2, "Gi": 1024**3, "K": 1000, "M": 1000**2, "G": 1000**3}


def redis_pod(objects: list[Obj]) -> Pod | None:
    return next((p for p in pods(objects) if p.component == "redis"), None)


def _redis_target(objects: list[Obj], url: str) -> tuple[str, int] | None:
    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss") or not parts.hostname:
        return None
    return service_target(objects, f"{parts.hostname}:{parts.port or 6379}")


def _urls(cfg: MeshConfig, component: str) -> dict[str, str]:
    """Setting -> the Redis URL it names, for what `component` uses."""
    if component == "scheduler":
        return {"scheduler.incarnations_redis_url": cfg.scheduler.incarnations_redis_url}
    cache = cfg.gateway.response_cache
    return {"gateway.response_cache.redis_url": cache.redis_url}


def check_shared_state(objects: list[Obj]) -> list[str]:
    redis = redis_pod(objects)
    if redis is None:
        return ["no Redis workload (component redis): the gateways' Responses store would be per pod"]
    want = ("redis", listening_ports(objects, redis).get("redis"))
    problems = []
    for pod in (p for p in pods(objects) if p.component in REDIS_USERS):
        cfg, found = mesh_config(objects, pod)
        problems += found
        if cfg is None:
            continue
        if pod.component == "gateway":
            if cfg.responses.store != "redis":
                problems.append(f"{pod.name}: responses.store is {cfg.responses.store!r}: a continuation "
                                "(previous_response_id) landing on another gateway pod would get 404")
            if cfg.gateway.response_cache.store != "redis":
                problems.append(f"{pod.name}: gateway.response_cache.store is "
                                f"{cfg.gateway.response_cache.store!r}: one cache per pod, not the shared one")
        for setting, url in _urls(cfg, pod.component).items():
            if _redis_target(objects, url) != want:
                problems.append(f"{pod.name}: {setting} {url!r} is not the Redis Service's port {want[1]}")
    return problems


def check_redis_access(objects: list[Obj]) -> list[str]:
    redis = redis_pod(objects)
    port = listening_ports(objects, redis).get("redis") if redis is not None else None
    if port is None:
        return ["no Redis workload listening on a port"]
    ns = namespace(objects)
    sources: dict[str, tuple[dict[str, str] | None, str]] = {
        "a client outside the cluster": (None, ""), "a pod of another namespace": ({"app": "x"}, "default"),
        "the namespace monitoring": ({"app.kubernetes.io/name": "prometheus"}, "monitoring"),
        **{p.component: (pod_labels(p), ns) for p in pods(objects) if p.component != "redis"},
    }
    problems = []
    for name, (labels, source_ns) in sources.items():
        allowed = policy_allows(objects, labels, source_ns, "redis", port)
        if allowed and name not in REDIS_USERS:
            problems.append(f"the NetworkPolicies let {name} reach Redis on {port} (only {REDIS_USERS} use it)")
        if not allowed and name in REDIS_USERS:
            problems.append(f"the NetworkPolicies keep the {name} from Redis on {port}")
    return problems


def _flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv[:-1] else None


def _bytes(value: str, units: dict[str, int]) -> int | None:
    """`<digits><unit>` in bytes (None: not one of `units`)."""
    match = re.fullmatch(r"(\d+)([A-Za-z]*)", value)
    if match is None or match.group(2) not in units:
        return None
    return int(match.group(1)) * units[match.group(2)]


def check_redis_bounded(objects: list[Obj]) -> list[str]:
    redis = redis_pod(objects)
    if redis is None:
        return ["no Redis workload"]
    problems = []
    image = redis.container.get("image", "")
    if not re.fullmatch(r"redis:\d+\.\d+\.\d+(-alpine)?", image):
        problems.append(f"{redis.name}: image {image!r} is not the official redis pinned to a version")
    argv = redis.argv()
    maxmemory = _bytes((_flag(argv, "--maxmemory") or "").lower(), _UNITS)  # Redis' units ignore case
    limit = _bytes(str(redis.container.get("resources", {}).get("limits", {}).get("memory", "")), _QUANTITY)
    if not maxmemory or limit is None or maxmemory > MAXMEMORY_SHARE * limit:
        problems.append(f"{redis.name}: --maxmemory {_flag(argv, '--maxmemory')} is not set at most "
                        f"{MAXMEMORY_SHARE:.0%} of the memory limit {limit}: Redis would grow until OOM-killed")
    policy = _flag(argv, "--maxmemory-policy") or "noeviction"
    if not policy.startswith("volatile-"):
        problems.append(f"{redis.name}: --maxmemory-policy {policy}: not volatile-* (evict what has a TTL, keep "
                        "the scheduler's incarnation hash)")
    gateway = next((p for p in pods(objects) if p.component == "gateway"), None)
    cfg = mesh_config(objects, gateway)[0] if gateway is not None else None
    if cfg is not None and maxmemory and cfg.responses.max_bytes > maxmemory:
        problems.append(f"{redis.name}: --maxmemory {maxmemory} is below one Responses entry's bound "
                        f"responses.max_bytes {cfg.responses.max_bytes}")
    return problems
