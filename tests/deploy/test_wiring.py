"""What the manifests run matches the code: each check on every overlay,
and each check failing on a manifest broken the way it guards against."""

from __future__ import annotations

import copy
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from .manifests import DEPLOY, OVERLAYS, Obj, kustomize, render
from .wiring import (
    PROBE_PATH,
    check_commands,
    check_config,
    check_drain,
    check_engine_identity,
    check_env,
    check_envoy,
    check_ports,
    find,
    pod_of,
    policy_allows,
)
from .wiring_monitoring import check_admin_keys, check_envoy_stats, check_scraped, check_tracing
from .wiring_scheduler import check_scheduler_disruption, check_scheduler_replicas

CHECKS: list[Callable[[list[Obj]], list[str]]] = [
    check_commands, check_env, check_config, check_ports, check_drain, check_engine_identity, check_envoy,
    check_scraped, check_envoy_stats, check_admin_keys, check_tracing, check_scheduler_replicas,
    check_scheduler_disruption,
]


@pytest.mark.parametrize("overlay", OVERLAYS)
@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_manifests_match_the_code(overlay: str, check: Callable[[list[Obj]], list[str]]) -> None:
    assert check(render(overlay)) == []


def _container(objects: list[Obj], component: str) -> dict:
    return pod_of(objects, component).container


def _config_map(objects: list[Obj]) -> dict:
    return next(o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"].startswith("kvmesh-config"))


def _broken(change: Callable[[list[Obj]], None]) -> list[Obj]:
    objects = copy.deepcopy(render("overlays/dev-cpu"))
    change(objects)
    return objects


def test_an_unknown_cli_flag_fails() -> None:
    objects = _broken(lambda o: _container(o, "gateway")["args"].__setitem__(1, "--replicas"))
    assert any("--replicas" in p for p in check_commands(objects))
    objects = _broken(lambda o: _container(o, "engine")["args"].__setitem__(1, "--engine-name"))
    assert any("--engine-name" in p for p in check_commands(objects))


def test_a_wrong_subcommand_or_prestop_fails() -> None:
    objects = _broken(lambda o: _container(o, "scheduler")["args"].__setitem__(0, "gateway"))
    assert any("not `kvmesh scheduler`" in p for p in check_commands(objects))
    objects = _broken(lambda o: _container(o, "engine")["lifecycle"]["preStop"]["exec"].__setitem__(
        "command", ["kvmesh", "drain", "--prot", "9200"]))
    assert any("preStop" in p for p in check_commands(objects))
    objects = _broken(lambda o: _container(o, "engine")["lifecycle"]["preStop"]["exec"].__setitem__(
        "command", ["kvmesh", "drain", "--port", "9102"]))
    assert any("does not drain the metrics port 9200" in p for p in check_drain(objects))


def test_an_env_var_nothing_reads_fails() -> None:
    objects = _broken(lambda o: _container(o, "gateway")["env"].append({"name": "KVMESH_CONFIG_FILE", "value": "x"}))
    assert any("KVMESH_CONFIG_FILE" in p for p in check_env(objects))
    objects = _broken(lambda o: _container(o, "engine")["env"].__setitem__(
        0, {"name": "POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}))
    problems = check_commands(objects) + check_engine_identity(objects)
    assert any("$(POD_NAME)" in p for p in problems)


def test_a_config_key_the_loader_refuses_fails() -> None:
    def bad_key(objects: list[Obj]) -> None:
        cm = _config_map(objects)
        cm["data"]["kvmesh.yaml"] = cm["data"]["kvmesh.yaml"].replace(
            "drain_unready_seconds: 3", "drain_unready_second: 3")
    assert any("drain_unready_second" in p for p in check_config(_broken(bad_key)))


    def loopback(objects: list[Obj]) -> None:
        cm = _config_map(objects)
        cm["data"]["kvmesh.yaml"] = cm["data"]["kvmesh.yaml"].replace("host: 0.0.0.0", "host: 127.0.0.1")
    assert any("unreachable from other pods" in p for p in check_config(_broken(loopback)))


def test_a_port_the_service_does_not_listen_on_fails() -> None:
    objects = _broken(lambda o: _container(o, "gateway")["ports"][0].__setitem__("containerPort", 8001))
    problems = check_ports(objects)
    assert any("listens on 8000" in p for p in problems) and any("containerPort 8001" in p for p in problems)
    # The reverse: a listening port no containerPort names.
    objects = _broken(lambda o: _container(o, "engine")["ports"].pop())
    assert any("listens on 9200 (metrics)" in p for p in check_ports(objects))

    def moved(objects: list[Obj]) -> None:
        cm = _config_map(objects)
        cm["data"]["kvmesh.yaml"] = cm["data"]["kvmesh.yaml"].replace("metrics_port: 9101", "metrics_port: 9111")
    assert any("9101" in p for p in check_ports(_broken(moved)))
    objects = _broken(lambda o: find(o, "Service", "kvmesh-engine")["spec"]["ports"][0].__setitem__(
        "targetPort", 50101))
    assert any("reaches nothing" in p for p in check_ports(objects))
    objects = _broken(lambda o: find(o, "Service", "kvmesh-gateway")["spec"].pop("clusterIP"))
    assert any("not headless" in p for p in check_ports(objects))


def test_a_wrong_probe_fails() -> None:
    objects = _broken(lambda o: _container(o, "engine")["readinessProbe"]["httpGet"].__setitem__("path", "/health"))
    assert any("readinessProbe path /health" in p for p in check_ports(objects))
    objects = _broken(lambda o: _container(o, "gateway")["livenessProbe"]["httpGet"].__setitem__("port", "http"))
    assert any("livenessProbe port http" in p for p in check_ports(objects))
    objects = _broken(lambda o: _container(o, "engine").pop("startupProbe"))
    assert any("no startupProbe" in p for p in check_ports(objects))


def test_the_probe_paths_are_the_ones_the_services_serve() -> None:
    from services.common.health_http import PROBE_PATHS

    assert sorted(PROBE_PATH.values()) == sorted(PROBE_PATHS)


def test_a_grace_period_below_the_drain_bound_fails() -> None:
    objects = _broken(lambda o: pod_of(o, "gateway").spec.__setitem__("terminationGracePeriodSeconds", 30))
    assert any("not above the drain bound 123 s" in p for p in check_drain(objects))
    # The shipped 130 s covers the default bound (the generation bound,
    # 120 s, after Envoy's 3 s); a longer generation bound needs more.
    def longer_generation(objects: list[Obj]) -> None:
        cm = _config_map(objects)
        cm["data"]["kvmesh.yaml"] = cm["data"]["kvmesh.yaml"].replace(
            "drain_unready_seconds: 3", "drain_unready_seconds: 3\n  max_generation_seconds: 300")
    problems = check_drain(_broken(longer_generation))
    assert any("kvmesh-gateway: terminationGracePeriodSeconds 130 is not above the drain bound 303 s" in p
               for p in problems)
    assert any("kvmesh-envoy: preStop sleeps 125 s, less than the gateways' drain bound 303 s" in p
               for p in problems)


def test_envoy_drain_shorter_than_the_gateways_fails() -> None:
    objects = _broken(lambda o: pod_of(o, "envoy").container["lifecycle"]["preStop"]["sleep"].__setitem__(
        "seconds", 5))
    assert any("preStop sleeps 5 s, less than the gateways' drain bound 123 s" in p for p in check_drain(objects))
    objects = _broken(lambda o: pod_of(o, "envoy").spec.__setitem__("terminationGracePeriodSeconds", 125))
    assert any("kvmesh-envoy: terminationGracePeriodSeconds 125 is not above its preStop sleep" in p
               for p in check_drain(objects))


def test_a_wrong_engine_identity_fails() -> None:
    def ip(objects: list[Obj]) -> None:
        args = _container(objects, "engine")["args"]
        wrong = "$(POD_NAME).kvmesh-engines.$(POD_NAMESPACE).svc.cluster.local:50100"
        args[args.index("--advertise-address") + 1] = wrong
    assert any("--advertise-address" in p for p in check_engine_identity(_broken(ip)))


def test_envoy_pointing_elsewhere_fails() -> None:
    def rename(objects: list[Obj]) -> None:
        cm = next(o for o in objects if o["metadata"]["name"].startswith("kvmesh-envoy") and o["kind"] == "ConfigMap")
        cm["data"]["envoy.yaml"] = cm["data"]["envoy.yaml"].replace("kvmesh-gateway.kvmesh", "kvmesh-gateways.kvmesh")
    assert any("kvmesh-gateways" in p for p in check_envoy(_broken(rename)))
    ca_only = {"secretName": "kvmesh-mesh-tls", "items": [{"key": "ca.pem", "path": "ca.pem"}]}
    objects = _broken(lambda o: pod_of(o, "envoy").spec["volumes"].__setitem__(
        2, {"name": "mesh-tls", "secret": ca_only}))
    assert any("envoy-key.pem" in p for p in check_envoy(objects))


def test_a_manifest_file_with_a_wrong_flag_fails(tmp_path: Path) -> None:
    """The same checks on a copy of deploy/ whose gateway.yaml was edited."""
    work = tmp_path / "deploy"
    subprocess.run(["cp", "-r", str(DEPLOY), str(work)], check=True)
    gateway = work / "base" / "gateway.yaml"
    gateway.write_text(gateway.read_text().replace('"--replica", "0"', '"--replica", "zero"'))
    objects = kustomize(work / "overlays" / "dev-cpu")
    assert any("--replica: invalid int value" in p for p in check_commands(objects))


def test_network_policies_hold_their_intent() -> None:
    """Only Envoy from outside; gateways from Envoy; the batch service's API
    from Envoy (its lines go back through Envoy's listener); the scheduler
    from gateways and engines; engines from gateways and the scheduler;
    metrics (and probes' port) and Envoy's stats port from the namespace
    `monitoring` only."""
    for overlay in OVERLAYS:
        objects = render(overlay)
        ns = "kvmesh"
        labels = {c: pod_of(objects, c).workload["spec"]["template"]["metadata"]["labels"]
                  for c in ("scheduler", "gateway", "engine", "batch", "envoy")}
        outside = {"name": "client"}
        expect = {
            ("envoy", 8080): {"outside", "other", "monitoring", "scheduler", "gateway", "engine", "batch", "envoy"},
            ("gateway", 8000): {"envoy"}, ("gateway", 50061): {"envoy"},
            ("batch", 8090): {"envoy"},
            ("scheduler", 50051): {"gateway", "engine", "scheduler"},
            ("engine", 50100): {"gateway", "scheduler"},
            ("scheduler", 9101): {"monitoring"}, ("gateway", 9102): {"monitoring"}, ("engine", 9200): {"monitoring"},
            ("batch", 9190): {"monitoring"}, ("envoy", 9902): {"monitoring"},
        }
        for (dest, port), allowed in expect.items():
            sources: dict[str, tuple[dict[str, str] | None, str]] = {
                "outside": (None, ""), "other": (outside, "default"),
                "monitoring": ({"app": "prometheus"}, "monitoring"),
                **{c: (labels[c], ns) for c in labels},
            }
            got = {name for name, (src, src_ns) in sources.items() if policy_allows(objects, src, src_ns, dest, port)}
            assert got == allowed, (overlay, dest, port)


def test_alerts_use_metrics_the_services_export() -> None:
    """Every series the rendered PrometheusRule reads is one a service's
    registry exports (services/observability/metric_catalogue.py) or a verified
    Envoy stat (services/observability/promql.py)."""
    from services.observability.metric_catalogue import exported_metric_names
    from services.observability.promql import known_names, metric_names

    rule = find(render("overlays/monitoring"), "PrometheusRule", "kvmesh")
    assert rule is not None
    exprs = [r["expr"] for g in rule["spec"]["groups"] for r in g["rules"]]
    names = {n for e in exprs for n in metric_names(e)}
    assert names
    known = known_names(set().union(*exported_metric_names().values()))
    assert names - known == set(), "PrometheusRule uses series no service exports"


def _monitoring_broken(change: Callable[[list[Obj]], None]) -> list[Obj]:
    objects = copy.deepcopy(render("overlays/monitoring"))
    change(objects)
    return objects


def _envoy_config(objects: list[Obj], old: str, new: str) -> None:
    cm = next(o for o in objects if o["metadata"]["name"].startswith("kvmesh-envoy") and o["kind"] == "ConfigMap")
    assert old in cm["data"]["envoy.yaml"]
    cm["data"]["envoy.yaml"] = cm["data"]["envoy.yaml"].replace(old, new)


def test_envoy_stats_port_declared_scraped_and_allowed() -> None:
    """The stats listener's port is a containerPort, the PodMonitor kvmesh-envoy
    scrapes /stats/prometheus on it, only `monitoring` may reach it."""
    objects = render("overlays/monitoring")
    envoy = pod_of(objects, "envoy")
    assert {p["name"]: p["containerPort"] for p in envoy.container["ports"]} == {"http": 8080, "metrics": 9902}
    monitor = find(objects, "PodMonitor", "kvmesh-envoy")
    assert monitor is not None and monitor["spec"]["podMetricsEndpoints"][0]["path"] == "/stats/prometheus"
    # Undeclared port, no PodMonitor, a wrong path, a policy without the port, a stats listener gone.
    objects = _broken(lambda o: pod_of(o, "envoy").container["ports"].pop())
    assert any("listens on 9902 (metrics)" in p for p in check_ports(objects))
    objects = _monitoring_broken(lambda o: o.remove(find(o, "PodMonitor", "kvmesh-envoy")))
    assert any("no monitor scrapes /stats/prometheus on port 9902" in p for p in check_scraped(objects))
    objects = _monitoring_broken(lambda o: find(o, "PodMonitor", "kvmesh-envoy")[
        "spec"]["podMetricsEndpoints"][0].__setitem__("path", "/metrics"))
    assert any("scrapes /metrics on 9902" in p for p in check_scraped(objects))
    objects = _broken(lambda o: find(o, "NetworkPolicy", "kvmesh-metrics-from-monitoring")[
        "spec"]["ingress"][0]["ports"].pop())
    assert any("keep the namespace monitoring from port 9902" in p for p in check_scraped(objects))
    objects = _broken(lambda o: _envoy_config(o, "  - name: stats\n    address", "  - name: stats2\n    address"))
    assert any("no stats listener" in p for p in check_envoy_stats(objects))


def test_envoy_stats_listener_forwarding_more_fails() -> None:
    objects = _broken(lambda o: _envoy_config(o, "path: /stats/prometheus", "prefix: /"))
    assert any("forwards" in p for p in check_envoy_stats(objects))
    objects = _broken(lambda o: _envoy_config(o, "exact: GET", "exact: POST"))
    assert any("forwards" in p for p in check_envoy_stats(objects))
    objects = _broken(lambda o: _envoy_config(o, "normalize_path: true", "normalize_path: false"))
    assert any("unnormalised" in p for p in check_envoy_stats(objects))


def test_admin_keys_file_is_a_mounted_secret_key() -> None:
    def unmounted(objects: list[Obj]) -> None:
        mounts = _container(objects, "scheduler")["volumeMounts"]
        mounts[:] = [m for m in mounts if m["name"] != "admin-keys"]
    assert any("admin_keys_file" in p for p in check_admin_keys(_broken(unmounted)))

    def wrong_key(objects: list[Obj]) -> None:
        vol = next(v for v in pod_of(objects, "scheduler").spec["volumes"] if v["name"] == "admin-keys")
        vol["secret"]["items"] = [{"key": "admin-keys.yaml", "path": "keys.yaml"}]
    assert any("admin_keys_file" in p for p in check_admin_keys(_broken(wrong_key)))

    def off(objects: list[Obj]) -> None:
        cm = _config_map(objects)
        cm["data"]["kvmesh.yaml"] = cm["data"]["kvmesh.yaml"].replace(
            "admin_keys_file: /etc/kvmesh/admin-keys/admin-keys.yaml", "")
    assert any("Admin service is off" in p for p in check_admin_keys(_broken(off)))
