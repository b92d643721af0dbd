"""Envoy's OpenTelemetry tracer in the rendered bootstrap: absent with tracing
off (the checked-in renderings stay as they are), present -- and accepted by
Envoy -- when the mesh config names an OTLP endpoint."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from services.common.config import MeshConfig, TracingConfig
from services.edge.render import render
from services.edge.topology import Topology, TopologyError
from services.edge.tracing import COLLECTOR_CLUSTER, TracingSpec
from services.launcher.envoy_config import load_run_topology, render_envoy
from services.launcher.mesh import envoy_binary


def _hcm(bootstrap: dict) -> dict:
    return bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]


def test_off_renders_no_tracer() -> None:
    bootstrap = render(Topology())
    assert "tracing" not in _hcm(bootstrap)
    assert COLLECTOR_CLUSTER not in [c["name"] for c in bootstrap["static_resources"]["clusters"]]


def test_mesh_tracing_turns_envoys_tracer_on(tmp_path: Path) -> None:
    config = MeshConfig(tracing=TracingConfig(otlp_endpoint="http://otel.example:4318", sample_ratio=0.25,
                                              headers={"authorization": "Bearer t"}))
    topology = load_run_topology(config, envoy=True)
    text = render_envoy(config, topology, 1, tmp_path)
    bootstrap = yaml.safe_load(text)
    tracing = _hcm(bootstrap)["tracing"]
    assert tracing["random_sampling"] == {"value": 25.0}
    provider = tracing["provider"]
    assert provider["name"] == "envoy.tracers.opentelemetry"
    service = provider["typed_config"]["http_service"]
    assert service["http_uri"]["uri"] == "http://otel.example:4318/v1/traces"
    assert service["http_uri"]["cluster"] == COLLECTOR_CLUSTER
    assert service["request_headers_to_add"] == [{"header": {"key": "authorization", "value": "Bearer t"}}]
    assert provider["typed_config"]["service_name"] == "kvmesh-envoy"
    (collector,) = [c for c in bootstrap["static_resources"]["clusters"] if c["name"] == COLLECTOR_CLUSTER]
    address = collector["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]
    assert address["socket_address"] == {"address": "otel.example", "port_value": 4318}
    out = tmp_path / "envoy.yaml"
    out.write_text(text)
    checked = subprocess.run([envoy_binary(), "--mode", "validate", "-c", str(out), "--use-dynamic-base-id"],
                             capture_output=True, text=True, timeout=120, check=False)
    assert checked.returncode == 0, checked.stderr[-2000:]


def test_https_collector_gets_tls_and_bad_specs_are_refused() -> None:
    spec = TracingSpec(traces_url="https://collector.example/v1/traces")
    bootstrap = render(Topology(tracing=spec))
    (collector,) = [c for c in bootstrap["static_resources"]["clusters"] if c["name"] == COLLECTOR_CLUSTER]
    assert collector["transport_socket"]["typed_config"]["sni"] == "collector.example"
    assert collector["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"][
        "socket_address"]["port_value"] == 443
    for bad in (TracingSpec(traces_url="collector:4318"),
                TracingSpec(traces_url="http://x/v1/traces", sampling_percent=101)):
        with pytest.raises(TopologyError, match="tracing"):
            Topology(tracing=bad).validate()
