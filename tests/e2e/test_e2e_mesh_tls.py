"""Mutual TLS between the services (`mesh_tls`), on a whole mesh of real
processes: clients still reach the public API through Envoy; the scheduler,
engines and gateways take no caller without a certificate of the mesh's CA,
and each RPC only from the roles that need it."""

from __future__ import annotations

import json
import os
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.config import MeshConfig
from services.common.mesh_tls import MeshIdentity, server_name, sync_channel
from services.common.proto.kvmesh.v1 import (
    admin_pb2,
    admin_pb2_grpc,
    common_pb2,
    engine_pb2,
    engine_pb2_grpc,
    inference_pb2,
    inference_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
)
from services.launcher.mesh import Mesh
from services.tools.devcerts import ensure_mesh_certs

MODEL = "tiny-llama"
TIMEOUT = 30.0


def MESH_TUNE(config: MeshConfig) -> None:  # noqa: N802 - the e2e_mesh fixture's hook
    config.mesh_tls.enabled = True
    config.engines.http_base_port = 1  # the engines' own OpenAI endpoints too (free ports)


def _identity(mesh: Mesh, role: str) -> MeshIdentity:
    return MeshIdentity.load(Path(mesh.config.mesh_tls.cert_dir), role)


def _health(channel: grpc.Channel) -> int:
    return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT).status


def _generate_request() -> engine_pb2.EngineGenerateMessage:
    return engine_pb2.EngineGenerateMessage(request=engine_pb2.EngineRequest(
        request_id="tls-probe", prompt_token_ids=[1, 2, 3, 4], priority=1,
        sampling=common_pb2.SamplingParams(max_tokens=2, temperature=0)))


def test_clients_reach_the_api_through_envoy(e2e_mesh: Mesh) -> None:
    body = json.dumps({"model": MODEL, "max_tokens": 4, "stream": True,
                       "messages": [{"role": "user", "content": "hi"}]}).encode()
    req = urllib.request.Request(
        f"{e2e_mesh.endpoints.public_http}/v1/chat/completions", data=body, method="POST",
        headers={"Authorization": f"Bearer {e2e_mesh.api_key}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=TIMEOUT) as resp:
        events = [line for line in resp.read().decode().splitlines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and len(events) >= 3
    with grpc.insecure_channel(e2e_mesh.endpoints.public_grpc) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        request = inference_pb2.ChatRequest(model=MODEL,
                                            messages=[inference_pb2.ChatMessage(role="user", content="hi")],
                                            sampling=common_pb2.SamplingParams(max_tokens=4))
        kinds = [e.WhichOneof("event") for e in stub.Chat(
            request, metadata=[("authorization", f"Bearer {e2e_mesh.api_key}")], timeout=TIMEOUT)]
    assert kinds[-1] == "finished"


def test_services_refuse_callers_without_a_mesh_certificate(e2e_mesh: Mesh, tmp_path: Path) -> None:
    ep = e2e_mesh.endpoints
    targets = {"scheduler": ep.scheduler, "engine": ep.engines[0], "gateway": ep.gateway_grpc[0]}
    # A certificate with the right names from another CA; it trusts the
    # mesh's CA, so the handshake fails on the server's side, not the client's.
    other = MeshIdentity.load(ensure_mesh_certs(tmp_path / "other-ca"), "admin")
    stranger = MeshIdentity("admin", _identity(e2e_mesh, "admin").ca_file, other.cert_file, other.key_file)
    for role, address in targets.items():
        with grpc.insecure_channel(address) as channel, pytest.raises(grpc.RpcError) as plain:
            _health(channel)
        assert plain.value.code() == grpc.StatusCode.UNAVAILABLE, role
        with sync_channel(address, stranger, role) as channel, pytest.raises(grpc.RpcError) as foreign:
            _health(channel)
        assert foreign.value.code() == grpc.StatusCode.UNAVAILABLE, role
        with sync_channel(address, _identity(e2e_mesh, "admin"), role) as channel:
            assert _health(channel) == health_pb2.HealthCheckResponse.SERVING, role

    # The gateway's HTTP port (Envoy's upstream) wants a mesh certificate too.
    health_url = f"{ep.gateway_http[0]}/health"
    assert health_url.startswith("https://")
    anonymous = ssl.create_default_context(cafile=str(_identity(e2e_mesh, "admin").ca_file))
    anonymous.check_hostname = False
    with pytest.raises((urllib.error.URLError, ssl.SSLError, ConnectionError)):
        urllib.request.urlopen(health_url, timeout=TIMEOUT, context=anonymous)
    with pytest.raises((urllib.error.URLError, ConnectionError)):
        urllib.request.urlopen(health_url.replace("https://", "http://"), timeout=TIMEOUT)
    # So does an engine's own OpenAI endpoint: it serves without the gateway's keys.
    engine_http = f"https://127.0.0.1:{e2e_mesh.config.engine_config(0).http_port}/health"
    with pytest.raises((urllib.error.URLError, ssl.SSLError, ConnectionError)):
        urllib.request.urlopen(engine_http, timeout=TIMEOUT, context=anonymous)
    admin = _identity(e2e_mesh, "admin").client_ssl_context()
    admin.check_hostname = False
    with urllib.request.urlopen(engine_http, timeout=TIMEOUT, context=admin) as resp:
        assert resp.status == 200


def test_a_server_must_prove_its_own_role(e2e_mesh: Mesh) -> None:
    """A gateway dialing what should be an engine, but is the scheduler, stops
    at the handshake: the scheduler's certificate does not name an engine."""
    with sync_channel(e2e_mesh.endpoints.scheduler, _identity(e2e_mesh, "gateway"), "engine") as channel, \
            pytest.raises(grpc.RpcError) as info:
        _health(channel)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert server_name("engine") != server_name("scheduler")


def test_each_rpc_takes_only_its_roles(e2e_mesh: Mesh) -> None:
    ep = e2e_mesh.endpoints
    with sync_channel(ep.scheduler, _identity(e2e_mesh, "admin"), "scheduler") as channel:
        state = scheduler_pb2_grpc.SchedulerStub(channel).GetState(scheduler_pb2.GetStateRequest(), timeout=TIMEOUT)
    assert len(state.engines) == 2

    # An engine's certificate cannot place requests on the scheduler ...
    with sync_channel(ep.scheduler, _identity(e2e_mesh, "engine"), "scheduler") as channel:
        admit = scheduler_pb2_grpc.SchedulerStub(channel).Admit(iter([scheduler_pb2.AdmitClientMessage(
            request=scheduler_pb2.AdmitRequest(request_id="r", model=MODEL, prompt_tokens=4, max_tokens=2))]),
            timeout=TIMEOUT)
        with pytest.raises(grpc.RpcError) as info:
            list(admit)
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "gateway" in info.value.details()

    # ... nor can an operator's generate on an engine, behind the gateway's keys.
    with sync_channel(ep.engines[0], _identity(e2e_mesh, "admin"), "engine") as channel:
        call = engine_pb2_grpc.EngineStub(channel).Generate(iter([_generate_request()]), timeout=TIMEOUT)
        with pytest.raises(grpc.RpcError) as info:
            list(call)
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    with sync_channel(ep.engines[0], _identity(e2e_mesh, "admin"), "engine") as channel:
        many = engine_pb2_grpc.EngineStub(channel).GenerateMany(iter([]), timeout=TIMEOUT)
        with pytest.raises(grpc.RpcError) as info:
            list(many)
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED

    # A gateway's certificate may (GenerateMany: served, then ended by the half-close).
    with sync_channel(ep.engines[0], _identity(e2e_mesh, "gateway"), "engine") as channel:
        events = list(engine_pb2_grpc.EngineStub(channel).Generate(iter([_generate_request()]), timeout=TIMEOUT))
        served = list(engine_pb2_grpc.EngineStub(channel).GenerateMany(iter([]), timeout=TIMEOUT))
    assert events[-1].HasField("finished")
    assert served == [engine_pb2.GenerateServerFrames()]
    assert e2e_mesh.exited() == []


def test_kvmesh_admin_and_top_use_the_admin_certificate(e2e_mesh: Mesh) -> None:
    """`kvmesh admin` and `kvmesh top` reach the TLS scheduler with the
    config's admin certificate; the Admin service takes no other role."""
    root = Path(__file__).resolve().parents[2]
    base = [sys.executable, "-m", "services.cli", "--config", str(e2e_mesh.config_path)]
    state = subprocess.run([*base, "admin", "--token-file", str(e2e_mesh.files.admin_token_path), "state"],
                           cwd=root, capture_output=True, text=True, timeout=60, check=False)
    assert state.returncode == 0 and "paused: none" in state.stdout, state
    top = subprocess.run([*base, "top", "--once", "--interval", "0.3"], cwd=root, capture_output=True, text=True,
                         timeout=60, check=False, env={**os.environ, "COLUMNS": "160"})
    assert top.returncode == 0 and "engine-0" in top.stdout and "engine-1" in top.stdout, top
    with sync_channel(e2e_mesh.endpoints.scheduler, _identity(e2e_mesh, "gateway"), "scheduler") as channel:
        with pytest.raises(grpc.RpcError) as info:
            admin_pb2_grpc.AdminStub(channel).GetAdminState(
                admin_pb2.GetAdminStateRequest(), timeout=TIMEOUT,
                metadata=(("authorization", f"Bearer {e2e_mesh.admin_token}"),))
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
