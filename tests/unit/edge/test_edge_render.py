"""The edge renderer: every topology renders to a config the real Envoy
accepts, the checked-in rendering is current, and the stream-safety rules
hold in what is rendered."""

from __future__ import annotations

import dataclasses
import subprocess
from pathlib import Path

import pytest
import yaml

from services.edge.render import ENVOY_DIR, main, render, render_yaml, rendered_path_for
from services.edge.topology import Topology, TopologyError, load_topology
from services.launcher.mesh import envoy_binary
from services.tools.devcerts import ensure_dev_certs, ensure_mesh_certs

ROOT = Path(__file__).resolve().parents[3]
TOPOLOGIES = sorted(ENVOY_DIR.glob("*.yaml"))


def test_there_are_topologies() -> None:
    assert (ENVOY_DIR / "topology.yaml") in TOPOLOGIES


@pytest.mark.parametrize("path", TOPOLOGIES, ids=lambda p: p.name)
def test_topology_renders_to_a_config_envoy_accepts(path: Path, tmp_path: Path) -> None:
    out = tmp_path / "envoy.yaml"
    topology = load_topology(path)
    if topology.tls.enabled:
        # Envoy reads the certificate files when it validates; use fresh dev certs.
        certs = ensure_dev_certs(tmp_path / "tls")
        topology = topology.with_files(ROOT, str(certs.cert_chain), str(certs.private_key))
    topology = _pod_files_here(topology, tmp_path)
    out.write_text(render_yaml(topology, path.name))
    # Relative paths in the config (the descriptor set) are relative to the repo root.
    result = subprocess.run(
        [envoy_binary(), "--mode", "validate", "-c", str(out), "--use-dynamic-base-id"],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=False,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "OK" in result.stdout + result.stderr


def _pod_files_here(topology: Topology, tmp_path: Path) -> Topology:
    """The Kubernetes topology names files of its pod (/etc/envoy/kvmesh.pb,
    /etc/envoy-web, the mesh certificates in /etc/kvmesh/tls): point them at
    this checkout's and at fresh mesh certificates, as the pod's volumes do."""
    if not topology.transcoder.descriptor.startswith("/etc/"):
        return topology
    mesh = ensure_mesh_certs(tmp_path / "mesh-tls")
    up = topology.upstream_tls
    return dataclasses.replace(
        topology,
        transcoder=dataclasses.replace(topology.transcoder, descriptor=str(ENVOY_DIR / "kvmesh.pb")),
        web=dataclasses.replace(topology.web, root=str(ROOT / "web")),
        upstream_tls=dataclasses.replace(
            up, cert_chain=str(mesh / "envoy.pem"), private_key=str(mesh / "envoy-key.pem"), ca=str(mesh / "ca.pem")),
    )


def test_checked_in_rendering_is_current(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["render", "--all", "--check"]) == 0, capsys.readouterr().err
    assert rendered_path_for(ENVOY_DIR / "topology.yaml") == ENVOY_DIR / "rendered" / "envoy.yaml"


def test_check_reports_a_stale_rendering(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    stale = tmp_path / "envoy.yaml"
    stale.write_text("# old\n")
    assert main(["render", "--topology", str(ENVOY_DIR / "topology.yaml"), "--out", str(stale), "--check"]) == 1
    assert "out of date" in capsys.readouterr().err


def test_render_requires_the_render_verb() -> None:
    with pytest.raises(SystemExit):
        main(["--all"])


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("listner: {port: 1}\n", "unknown setting(s) listner"),
        ("listener: {port: 1, hots: x}\n", "listener: unknown setting(s) hots"),
        ("listener: {port: 70000}\n", "listener.port: 70000 is not a TCP port"),
        ("gateways: []\n", "at least one gateway"),
        ("timeouts: {stream_idle_seconds: 0}\n", "timeouts.stream_idle_seconds: must be > 0"),
        ("max_request_bytes: 10\n", "max_request_bytes"),
        ("gateways: [{http_port: x}]\n", "gateways[0].http_port: expected an integer"),
    ],
)
def test_topology_is_strict(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "t.yaml"
    path.write_text(text)
    with pytest.raises(TopologyError, match=None) as info:
        load_topology(path)
    assert message in str(info.value)
    assert str(path) in str(info.value)


def test_idle_timeout_must_beat_the_heartbeat() -> None:
    topology = Topology()
    topology.timeouts.stream_idle_seconds = 20
    with pytest.raises(TopologyError, match="heartbeat"):
        topology.validate(heartbeat_seconds=15)
    topology.validate(heartbeat_seconds=5)


def _hcm(config: dict) -> dict:
    listener = config["static_resources"]["listeners"][0]
    return listener["filter_chains"][0]["filters"][0]["typed_config"]


def _routes(config: dict) -> dict[str, dict]:
    return {r["name"]: r for r in _hcm(config)["route_config"]["virtual_hosts"][0]["routes"]}


def test_streaming_routes_have_no_timeout_and_long_idle() -> None:
    config = render(Topology())
    hcm = _hcm(config)
    assert hcm["codec_type"] == "AUTO"
    assert hcm["generate_request_id"] is True and hcm["preserve_external_request_id"] is True
    assert float(hcm["stream_idle_timeout"].rstrip("s")) > 2 * 15  # beats the 15 s heartbeat
    for name, route in _routes(config).items():
        if "route" not in route:
            continue
        assert route["route"]["timeout"] == "0s", name
        assert float(route["route"]["idle_timeout"].rstrip("s")) > 30, name
        retry_on = route["route"]["retry_policy"]["retry_on"]
        # Only transport failures are retried (Envoy retries only before the
        # response started): never a 5xx or a status the gateway chose.
        assert set(retry_on.split(",")) <= {"connect-failure", "refused-stream", "reset-before-request", "reset"}


def test_grpc_goes_to_an_http2_cluster_and_openai_to_http1() -> None:
    config = render(Topology())
    routes = _routes(config)
    assert routes["grpc"]["route"]["cluster"] == "gateway_grpc"
    assert routes["grpc"]["match"] == {"prefix": "/kvmesh.v1.Inference/"}
    for prefix in ("/kvmesh.v1.Inference/", "/grpc.reflection.", "/grpc.health.v1.Health/"):
        assert any(r["match"].get("prefix") == prefix and r["route"]["cluster"] == "gateway_grpc"
                   for r in routes.values() if "route" in r)
    # Internal services and unknown gRPC are answered by Envoy (tests/fuzz/test_security.py).
    assert routes["grpc_internal_denied"]["direct_response"]["status"] == 404
    assert routes["grpc_other_denied"]["direct_response"]["status"] == 404
    assert routes["openai"]["match"] == {"prefix": "/v1/"}
    assert routes["openai"]["route"]["cluster"] == "gateway_http"
    assert routes["healthz"]["direct_response"]["status"] == 200
    clusters = {c["name"]: c for c in config["static_resources"]["clusters"]}
    opts = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
    grpc_http = clusters["gateway_grpc"]["typed_extension_protocol_options"][opts]["explicit_http_config"]
    http_http = clusters["gateway_http"]["typed_extension_protocol_options"][opts]["explicit_http_config"]
    assert "http2_protocol_options" in grpc_http
    assert "http_protocol_options" in http_http
    assert "grpc_health_check" in clusters["gateway_grpc"]["health_checks"][0]
    assert clusters["gateway_http"]["health_checks"][0]["http_health_check"]["path"] == "/health"


def test_body_limit_streams_instead_of_buffering() -> None:
    names = [f["name"] for f in _hcm(render(Topology()))["http_filters"]]
    assert "envoy.filters.http.body_size_limit" in names
    assert "envoy.filters.http.buffer" not in names
    assert names[-1] == "envoy.filters.http.router"


def test_the_body_limit_is_lifted_for_batch_file_uploads_only() -> None:
    """POST /v1/files (Batch API input, bounded by the batch service's
    batch.max_file_bytes) passes Envoy's request body limit; nothing else."""
    routes = _hcm(render(Topology()))["route_config"]["virtual_hosts"][0]["routes"]
    names = [r["name"] for r in routes]
    assert names.index("files_upload") < names.index("openai")
    upload = routes[names.index("files_upload")]
    assert upload["match"]["path"] == "/v1/files"
    assert upload["match"]["headers"] == [{"name": ":method", "string_match": {"exact": "POST"}}]
    assert upload["route"]["cluster"] == "batch_http"
    lifted = [r["name"] for r in routes
              if r.get("typed_per_filter_config", {}).get("envoy.filters.http.body_size_limit", {}).get("disabled")]
    assert lifted == ["files_upload"]


def test_files_and_batches_go_to_the_batch_service() -> None:
    """/v1/files and /v1/batches (and below) reach the batch service, never a
    gateway; with `batch.enabled: false` there is no batch cluster and
    those paths fall through to the gateways."""
    config = render(Topology())
    routes = _hcm(config)["route_config"]["virtual_hosts"][0]["routes"]
    names = [r["name"] for r in routes]
    to_batch = {r["name"]: r["match"] for r in routes if r.get("route", {}).get("cluster") == "batch_http"}
    assert to_batch == {"files_upload": routes[names.index("files_upload")]["match"],
                        "files": {"path_separated_prefix": "/v1/files"},
                        "batches": {"path_separated_prefix": "/v1/batches"}}
    assert max(names.index(n) for n in to_batch) < names.index("openai")
    # The batch service's lines reach the gateways with no idle timeout (they wait silently in the queue).
    lines = routes[names.index("batch_lines")]
    assert names.index("batch_lines") < names.index("openai") and lines["route"]["cluster"] == "gateway_http"
    assert lines["match"]["headers"] == [{"name": "x-kvmesh-batch-key-id", "present_match": True}]
    assert lines["route"]["idle_timeout"] == "86400s" and lines["route"]["timeout"] == "0s"
    batch = next(c for c in config["static_resources"]["clusters"] if c["name"] == "batch_http")
    assert batch["load_assignment"]["endpoints"][0]["lb_endpoints"] == [
        {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 8090}}}}]
    assert batch["health_checks"][0]["http_health_check"] == {"path": "/health"}
    off = Topology()
    off.batch.enabled = False
    config = render(off)
    assert "batch_http" not in [c["name"] for c in config["static_resources"]["clusters"]]
    routes = _hcm(config)["route_config"]["virtual_hosts"][0]["routes"]
    assert not {"files_upload", "files", "batches", "batch_lines"} & {r["name"] for r in routes}


def test_every_replica_is_an_endpoint() -> None:
    topology = load_topology(ENVOY_DIR / "topology-replicas.yaml")
    config = yaml.safe_load(render_yaml(topology))
    for cluster in config["static_resources"]["clusters"]:
        if cluster["name"] == "batch_http":
            continue   # the one batch service (test_files_and_batches_go_to_the_batch_service)
        endpoints = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]
        assert len(endpoints) == len(topology.gateways) == 3
        assert cluster["outlier_detection"]["enforcing_consecutive_5xx"] == 0
        # A gateway's health change is used at once (the k8s_netns conversation
        # test: within Envoy's default 1 s merge window a retry went back to a
        # SIGKILLed gateway, the live one not yet in the workers' balancers).
        assert cluster["common_lb_config"] == {"update_merge_window": "0s"}
    names = [f["name"] for f in _hcm(config)["http_filters"]]
    assert names[0] == "envoy.filters.http.cors"
    assert "envoy.filters.http.local_ratelimit" in names


def test_a_silent_gateway_cannot_hold_a_request_and_retries_get_their_own_id() -> None:
    """A request written to a gateway cut off without a reset is reset by the
    kernel after the keepalive bound (TCP_USER_TIMEOUT), then retried; the
    retry carries x-envoy-attempt-count so the gateway gives it its own id
    (tests/netns/test_netns_partitions.py shows it on a real cut)."""
    topology = Topology()
    config = render(topology)
    t = topology.timeouts
    for c in config["static_resources"]["clusters"]:
        if c["name"] not in ("gateway_grpc", "gateway_http"):
            continue
        (option,) = c["upstream_bind_config"]["socket_options"]
        assert (option["level"], option["name"]) == (6, 18)  # IPPROTO_TCP, TCP_USER_TIMEOUT
        assert option["int_value"] == round(
            (t.upstream_keepalive_seconds + t.upstream_keepalive_timeout_seconds) * 1000)
        assert c["close_connections_on_host_health_failure"] is True
    vhost = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"][
        "route_config"]["virtual_hosts"][0]
    assert vhost["include_request_attempt_count"] is True
