"""Two gateway replicas behind the real Envoy: when one dies, Envoy's
connect-failure retries and health checks keep every request working."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import grpc

from services.common.proto.kvmesh.v1 import common_pb2, inference_pb2, inference_pb2_grpc
from services.launcher.mesh import Mesh

MESH_GATEWAYS = 2
MODEL = "tiny-llama"


def _chat_http(mesh: Mesh) -> dict:
    body = json.dumps({"model": MODEL, "max_tokens": 4,
                       "messages": [{"role": "user", "content": "hi"}]}).encode()
    req = urllib.request.Request(
        f"{mesh.endpoints.public_http}/v1/chat/completions", data=body, method="POST",
        headers={"Authorization": f"Bearer {mesh.api_key}", "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            assert resp.status == 200
            return json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        # Envoy's access log says which replica answered and why (flags, details).
        raise AssertionError(
            f"HTTP {exc.code}: {exc.read()[:500]!r}\n--- envoy log ---\n{mesh.log_tail('envoy', 6)}"
        ) from exc


def _chat_grpc(stub: inference_pb2_grpc.InferenceStub, mesh: Mesh) -> list[str]:
    request = inference_pb2.ChatRequest(
        model=MODEL, messages=[inference_pb2.ChatMessage(role="user", content="hi")],
        sampling=common_pb2.SamplingParams(max_tokens=4),
    )
    meta = [("authorization", f"Bearer {mesh.api_key}")]
    return [e.WhichOneof("event") for e in stub.Chat(request, metadata=meta, timeout=60)]


def test_both_replicas_serve_then_one_dies_and_nothing_fails(e2e_mesh: Mesh) -> None:
    assert len(e2e_mesh.endpoints.gateway_http) == 2
    with grpc.insecure_channel(e2e_mesh.endpoints.public_grpc) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        for _ in range(4):
            assert _chat_http(e2e_mesh)["object"] == "chat.completion"
            assert _chat_grpc(stub, e2e_mesh)[-1] == "finished"
        e2e_mesh.kill("gateway-1")
        # Right away, before any health check noticed: connect failures are
        # retried on the other replica.
        for _ in range(8):
            assert _chat_http(e2e_mesh)["choices"][0]["message"]["content"]
            assert _chat_grpc(stub, e2e_mesh)[-1] == "finished"
    assert e2e_mesh.exited() == []
    assert e2e_mesh.is_running("gateway-0") and e2e_mesh.is_running("envoy")
