"""The batch service's manifests match the code (wiring_batch.py) on every
overlay, and each check fails on a manifest broken the way it guards
against: the database on scratch, two writers, the credential missing on
one side, lines sent where nothing answers, Envoy or the policies not
letting requests reach the batch pod."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from .breaking import broken as _broken
from .breaking import config_edit as _config
from .manifests import OVERLAYS, Obj, render
from .wiring import check_commands, check_drain, check_ports, find, pod_of
from .wiring_batch import check_batch_credentials, check_batch_path, check_batch_state

CHECKS: list[Callable[[list[Obj]], list[str]]] = [check_batch_state, check_batch_credentials, check_batch_path]


@pytest.mark.parametrize("overlay", OVERLAYS)
@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_batch_manifests_match_the_code(overlay: str, check: Callable[[list[Obj]], list[str]]) -> None:
    assert check(render(overlay)) == []


def _batch(objects: list[Obj]) -> dict[str, Any]:
    return pod_of(objects, "batch").container


def test_the_database_off_the_claim_or_two_replicas_fail() -> None:
    on_tmp = _config("database: /var/lib/kvmesh-batch/batch.sqlite3", "database: /tmp/batch.sqlite3")
    assert any("not a volumeClaimTemplate" in p for p in check_batch_state(_broken(on_tmp)))
    nowhere = _config("database: /var/lib/kvmesh-batch/batch.sqlite3", "database: /srv/batch.sqlite3")
    assert any("on no mounted volume" in p for p in check_batch_state(_broken(nowhere)))
    read_only = _broken(lambda o: next(m for m in _batch(o)["volumeMounts"] if m["name"] == "batch-state")
                        .__setitem__("readOnly", True))
    assert any("not mounted writable" in p for p in check_batch_state(read_only))
    two = _broken(lambda o: find(o, "StatefulSet", "kvmesh-batch")["spec"].__setitem__("replicas", 2))
    assert any("exactly 1 replica" in p for p in check_batch_state(two))
    off = _config("  enabled: true\n  host: 0.0.0.0\n  port: 8090", "  enabled: false\n  host: 0.0.0.0\n  port: 8090")
    assert any("batch.enabled is false" in p for p in check_batch_state(_broken(off)))


def test_the_credential_missing_on_either_side_fails() -> None:
    def unmount(component: str) -> Callable[[list[Obj]], None]:
        def change(objects: list[Obj]) -> None:
            mounts = pod_of(objects, component).container["volumeMounts"]
            mounts[:] = [m for m in mounts if m["name"] != "batch-key"]
        return change
    for component in ("batch", "gateway"):
        assert any("internal_key_file" in p and component in p
                   for p in check_batch_credentials(_broken(unmount(component)))), component

    def no_api_keys(objects: list[Obj]) -> None:
        mounts = _batch(objects)["volumeMounts"]
        mounts[:] = [m for m in mounts if m["name"] != "api-keys"]
    assert any("api_keys_file" in p for p in check_batch_credentials(_broken(no_api_keys)))


def test_lines_sent_where_nothing_answers_fail() -> None:
    for url in ("http://kvmesh-envoy:8081", "http://kvmesh-scheduler:50051", "http://kvmesh-envoys:8080"):
        broken = _broken(_config("gateway_url: http://kvmesh-envoy:8080", f"gateway_url: {url}"))
        assert any("batch.gateway_url" in p for p in check_batch_path(broken)), url


def test_envoy_or_policies_not_reaching_the_batch_pod_fail() -> None:
    def drop_policy(objects: list[Obj]) -> None:
        objects.remove(find(objects, "NetworkPolicy", "kvmesh-batch-from-envoy"))  # type: ignore[arg-type]  # find returns the object it found, typed loosely
    assert any("keep Envoy from the batch pod" in p for p in check_batch_path(_broken(drop_policy)))

    def elsewhere(objects: list[Obj]) -> None:
        cm = next(o for o in objects if o["metadata"]["name"].startswith("kvmesh-envoy") and o["kind"] == "ConfigMap")
        assert "kvmesh-batch.kvmesh.svc.cluster.local" in cm["data"]["envoy.yaml"]
        cm["data"]["envoy.yaml"] = cm["data"]["envoy.yaml"].replace("kvmesh-batch.kvmesh.svc.cluster.local",
                                                                    "kvmesh-gateway.kvmesh.svc.cluster.local")
    assert any("no cluster for the batch Service" in p for p in check_batch_path(_broken(elsewhere)))

    def to_batch(objects: list[Obj]) -> None:
        """Envoy's route for the batch service's lines sent to the batch service itself (a loop)."""
        cm = next(o for o in objects if o["metadata"]["name"].startswith("kvmesh-envoy") and o["kind"] == "ConfigMap")
        old = "present_match: true\n                route:\n                  cluster: gateway_http"
        assert old in cm["data"]["envoy.yaml"]
        cm["data"]["envoy.yaml"] = cm["data"]["envoy.yaml"].replace(old, old.replace("gateway_http", "batch_http"))
    assert any("the batch service's lines" in p for p in check_batch_path(_broken(to_batch)))

    def files_to_gateways(objects: list[Obj]) -> None:
        cm = next(o for o in objects if o["metadata"]["name"].startswith("kvmesh-envoy") and o["kind"] == "ConfigMap")
        old = "path_separated_prefix: /v1/files"
        assert old in cm["data"]["envoy.yaml"]
        cm["data"]["envoy.yaml"] = cm["data"]["envoy.yaml"].replace(old, "path_separated_prefix: /v1/filez")
    assert any("GET /v1/files to 'gateway_http'" in p for p in check_batch_path(_broken(files_to_gateways)))


def test_the_generic_checks_cover_the_batch_pod() -> None:
    """Its command line, ports, probes and drain go through the same checks as the others'."""
    wrong_flag = _broken(lambda o: _batch(o)["args"].append("--prot"))
    assert any("kvmesh-batch" in p for p in check_commands(wrong_flag))
    wrong_port = _broken(lambda o: _batch(o)["ports"][0].__setitem__("containerPort", 8091))
    assert any("listens on 8090" in p for p in check_ports(wrong_port))
    wrong_probe = _broken(lambda o: _batch(o)["readinessProbe"]["httpGet"].__setitem__("port", "http"))
    assert any("readinessProbe port http" in p for p in check_ports(wrong_probe))
    short = _broken(lambda o: pod_of(o, "batch").spec.__setitem__("terminationGracePeriodSeconds", 6))
    assert any("kvmesh-batch" in p and "drain bound" in p for p in check_drain(short))
    no_drain = _broken(lambda o: _batch(o).pop("lifecycle"))
    assert any("kvmesh-batch: no preStop drain" in p for p in check_drain(no_drain))
