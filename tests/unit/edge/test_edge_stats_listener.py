"""The stats-only listener (services/edge/stats.py), in a real Envoy started
from the Kubernetes topology (envoy/topology-kubernetes.yaml: its stats
listener, on loopback ports here): GET /stats/prometheus answers Envoy's
Prometheus text; every other admin path, another method, a path that
normalises to another admin path, answers 404 from the listener -- and the
admin interface saw none of them (/quitquitquit did not stop Envoy)."""

from __future__ import annotations

import dataclasses
import http.client
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from services.edge.render import ENVOY_DIR, render, render_yaml
from services.edge.stats import ADMIN_CLUSTER, STATS_PATH, StatsSpec
from services.edge.topology import AdminSpec, GatewayEndpoint, ListenerSpec, Topology, TopologyError, load_topology
from services.launcher.mesh import envoy_binary
from services.launcher.ports import free_port
from services.tools.devcerts import ensure_mesh_certs

ROOT = Path(__file__).resolve().parents[3]
KUBERNETES = ENVOY_DIR / "topology-kubernetes.yaml"


def _get(port: int, path: str, method: str = "GET") -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request(method, path)
        answer = conn.getresponse()
        return answer.status, answer.read()
    finally:
        conn.close()


def _local(tmp_path: Path) -> tuple[Topology, int, int]:
    """The Kubernetes topology on loopback ports, with this checkout's files."""
    k8s = load_topology(KUBERNETES)
    assert k8s.stats.enabled and k8s.stats.host == "0.0.0.0"
    mesh = ensure_mesh_certs(tmp_path / "mesh-tls")
    admin, stats = free_port(), free_port()
    topology = k8s.with_ports(ListenerSpec(port=free_port()), AdminSpec(port=admin),
                              [GatewayEndpoint(http_port=free_port(), grpc_port=free_port())])
    topology = dataclasses.replace(
        topology,
        stats=dataclasses.replace(k8s.stats, host="127.0.0.1", port=stats),
        transcoder=dataclasses.replace(k8s.transcoder, descriptor=str(ENVOY_DIR / "kvmesh.pb")),
        web=dataclasses.replace(k8s.web, root=str(ROOT / "web")),
        upstream_tls=dataclasses.replace(k8s.upstream_tls, cert_chain=str(mesh / "envoy.pem"),
                                         private_key=str(mesh / "envoy-key.pem"), ca=str(mesh / "ca.pem")),
    )
    return topology, admin, stats


@pytest.fixture(scope="module")
def envoy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[subprocess.Popen[bytes], int, int]]:
    tmp_path = tmp_path_factory.mktemp("stats")
    topology, admin, stats = _local(tmp_path)
    config = tmp_path / "envoy.yaml"
    config.write_text(render_yaml(topology))
    with open(tmp_path / "envoy.log", "wb") as log:
        proc = subprocess.Popen([envoy_binary(), "-c", str(config), "--use-dynamic-base-id", "--log-level", "warning"],
                                cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.monotonic() + 60
            while True:
                assert proc.poll() is None, (tmp_path / "envoy.log").read_text()[-3000:]
                try:
                    if _get(admin, "/ready")[0] == 200:
                        break
                except OSError:
                    pass
                assert time.monotonic() < deadline, "Envoy not ready within 60 s"
                time.sleep(0.1)
            yield proc, admin, stats
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def test_stats_listener_serves_prometheus_stats(envoy: tuple[subprocess.Popen[bytes], int, int]) -> None:
    _, _, stats = envoy
    for path in (STATS_PATH, f"{STATS_PATH}?usedonly"):
        status, body = _get(stats, path)
        assert status == 200, (path, body[:200])
        assert b"# TYPE envoy_cluster_membership_healthy gauge" in body
        assert b'envoy_cluster_membership_healthy{envoy_cluster_name="gateway_http"}' in body


@pytest.mark.parametrize("method, path", [
    ("POST", "/quitquitquit"), ("GET", "/quitquitquit"), ("GET", "/config_dump"), ("GET", "/stats"),
    ("GET", "/clusters"), ("POST", "/logging?level=trace"), ("POST", "/runtime_modify?a=b"),
    ("POST", "/healthcheck/fail"), ("GET", "/ready"), ("GET", "/"),
    ("POST", STATS_PATH), ("GET", f"{STATS_PATH}/"), ("GET", "/stats/prometheusx"),
    ("GET", f"{STATS_PATH}/../../config_dump"), ("GET", "/stats/../quitquitquit"),
])
def test_other_admin_paths_are_404(envoy: tuple[subprocess.Popen[bytes], int, int], method: str, path: str) -> None:
    proc, admin, stats = envoy
    status, body = _get(stats, path, method)
    assert status == 404, (method, path, status, body[:200])
    assert proc.poll() is None
    # The admin interface itself (loopback) is untouched: still live, not failing health checks.
    assert _get(admin, "/ready")[0] == 200


def test_escaped_slashes_are_refused(envoy: tuple[subprocess.Popen[bytes], int, int]) -> None:
    _, _, stats = envoy
    assert _get(stats, "/stats%2Fprometheus")[0] in (400, 404)
    assert _get(stats, "/stats/prometheus%2F..%2F..%2Fconfig_dump")[0] in (400, 404)


def test_off_by_default_and_checked() -> None:
    boot = render(Topology())
    assert [listener["name"] for listener in boot["static_resources"]["listeners"]] == ["public"]
    assert ADMIN_CLUSTER not in {c["name"] for c in boot["static_resources"]["clusters"]}
    for rendered in sorted((ENVOY_DIR / "rendered").glob("envoy*.yaml")):
        names = [listener["name"] for listener in yaml.safe_load(rendered.read_text())["static_resources"]["listeners"]]
        assert names == (["public", "stats"] if rendered.name.startswith("envoy-kubernetes") else ["public"]), rendered
    with pytest.raises(TopologyError, match=r"stats\.port: 9901 is already admin\.port"):
        dataclasses.replace(Topology(), stats=StatsSpec(port=9901)).validate()
    with pytest.raises(TopologyError, match=r"stats\.port: 70000"):
        dataclasses.replace(Topology(), stats=StatsSpec(port=70000)).validate()
