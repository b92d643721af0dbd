"""The shared Redis's manifests match the code (wiring_redis.py) on every
overlay, and each check fails on a manifest broken the way it guards
against: a gateway back on the per-pod Responses store, a URL naming no
Redis Service, a policy letting another pod in (or keeping a user out), a
Redis without a memory bound or with an eviction policy that may drop the
incarnation record, an unpinned image, a probe or port that does not match
what redis-server listens on."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from .breaking import broken, config_edit
from .manifests import OVERLAYS, Obj, render
from .wiring import check_ports, find
from .wiring_redis import check_redis_access, check_redis_bounded, check_shared_state, redis_pod

CHECKS: list[Callable[[list[Obj]], list[str]]] = [check_shared_state, check_redis_access, check_redis_bounded]
URL = "redis://kvmesh-redis:6379/0"


@pytest.mark.parametrize("overlay", OVERLAYS)
@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_redis_manifests_match_the_code(overlay: str, check: Callable[[list[Obj]], list[str]]) -> None:
    assert check(render(overlay)) == []


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_overlay_shares_the_responses_store_across_its_gateways(overlay: str) -> None:
    """More than one gateway pod in every overlay, so the store must be shared."""
    objects = render(overlay)
    gateways = find(objects, "Deployment", "kvmesh-gateway")
    hpa = find(objects, "HorizontalPodAutoscaler", "kvmesh-gateway")
    assert gateways is not None and hpa is not None
    assert gateways["spec"]["replicas"] > 1 and hpa["spec"]["minReplicas"] > 1
    assert check_shared_state(objects) == []


def _redis(objects: list[Obj]) -> dict[str, Any]:
    pod = redis_pod(objects)
    assert pod is not None
    return pod.container


def _arg(flag: str, value: str) -> Callable[[list[Obj]], None]:
    def change(objects: list[Obj]) -> None:
        args = _redis(objects)["args"]
        args[args.index(flag) + 1] = value
    return change


def test_a_gateway_on_its_own_store_or_another_redis_fails() -> None:
    embedded = config_edit("responses:\n  store: redis", "responses:\n  store: embedded")
    assert any("responses.store is 'embedded'" in p and "404" in p for p in check_shared_state(broken(embedded)))
    cache = config_edit("    store: redis\n    redis_url", "    store: embedded\n    redis_url")
    assert any("response_cache.store is 'embedded'" in p for p in check_shared_state(broken(cache)))
    elsewhere = config_edit(f"    redis_url: {URL}", "    redis_url: redis://redis:6379/0")
    assert any("redis://redis:6379/0" in p and "gateway" in p for p in check_shared_state(broken(elsewhere)))
    port = config_edit(f"    redis_url: {URL}", "    redis_url: redis://kvmesh-redis:6380/0")
    assert any("6380" in p for p in check_shared_state(broken(port)))
    scheduler = config_edit(f"incarnations_redis_url: {URL}", "incarnations_redis_url: redis://kvmesh-cache:6379/0")
    assert any("scheduler.incarnations_redis_url" in p for p in check_shared_state(broken(scheduler)))


def test_the_manifests_without_redis_fail() -> None:
    """The manifests as they were: no Redis workload, every gateway on its own store."""
    def without(objects: list[Obj]) -> None:
        objects[:] = [o for o in objects if "redis" not in o["metadata"]["name"]]
        config_edit("responses:\n  store: redis", "responses:\n  store: embedded")(objects)
    problems = check_shared_state(broken(without))
    assert any("no Redis workload" in p for p in problems)


def test_a_policy_letting_others_in_or_users_out_fails() -> None:
    policy = "kvmesh-redis-from-mesh"
    open_ = broken(lambda o: find(o, "NetworkPolicy", policy)["spec"]["ingress"][0].pop("from"))
    problems = check_redis_access(open_)
    for who in ("envoy", "engine", "batch", "a client outside the cluster", "the namespace monitoring"):
        assert any(f"let {who} reach Redis" in p for p in problems), (who, problems)
    engines = broken(lambda o: find(o, "NetworkPolicy", policy)["spec"]["ingress"][0]["from"].append(
        {"podSelector": {"matchLabels": {"app.kubernetes.io/component": "engine"}}}))
    assert [p for p in check_redis_access(engines) if "engine" in p]
    def without_policy(objects: list[Obj]) -> None:
        objects[:] = [o for o in objects if o["metadata"]["name"] != policy]
    problems = check_redis_access(broken(without_policy))
    assert any("keep the gateway from Redis" in p for p in problems)
    assert any("keep the scheduler from Redis" in p for p in problems)
    wrong_port = broken(lambda o: find(o, "NetworkPolicy", policy)["spec"]["ingress"][0]["ports"][0].__setitem__(
        "port", 6380))
    assert any("keep the gateway from Redis on 6379" in p for p in check_redis_access(wrong_port))


def test_an_unbounded_or_unpinned_redis_fails() -> None:
    assert any("--maxmemory" in p for p in check_redis_bounded(broken(_arg("--maxmemory", "1gb"))))
    assert any("--maxmemory" in p for p in check_redis_bounded(broken(_arg("--maxmemory", "0"))))
    assert any("responses.max_bytes" in p for p in check_redis_bounded(broken(_arg("--maxmemory", "32mb"))))
    assert any("allkeys-lru" in p for p in check_redis_bounded(broken(_arg("--maxmemory-policy", "allkeys-lru"))))
    no_limit = broken(lambda o: _redis(o)["resources"].pop("limits"))
    assert any("memory limit" in p for p in check_redis_bounded(no_limit))
    for image in ("redis", "redis:latest", "redis:7-alpine", "bitnami/redis:7.2.10"):
        unpinned = broken(lambda o, i=image: _redis(o).__setitem__("image", i))  # type: ignore[misc]  # mypy cannot type a lambda with a default argument
        assert any("pinned" in p for p in check_redis_bounded(unpinned)), image


def test_a_redis_port_or_probe_off_its_listener_fails() -> None:
    moved = broken(_arg("--port", "6380"))
    problems = check_ports(moved)
    assert any("listens on 6380 (redis)" in p for p in problems)
    assert any("containerPort 6379 is no port" in p for p in problems)
    assert any("readinessProbe" in p and "redis-cli -p 6380 ping" in p for p in problems)
    assert any("kvmesh-redis" in p and "reaches nothing" in p for p in problems)
    probe = broken(lambda o: _redis(o)["livenessProbe"]["exec"].__setitem__("command", ["redis-cli", "ping"]))
    assert any("livenessProbe" in p for p in check_ports(probe))
