"""Regression tests for the bugs fuzzing found (each was a 500 / UNKNOWN
for bad input). Pure functions where the bug lived there; a real service
where it lived in the transport."""

from __future__ import annotations

import json

import grpc
import httpx
import pytest

from services.common.openai_api.requests import parse_chat_body, parse_completion_body
from services.common.proto.kvmesh.v1 import engine_pb2, engine_pb2_grpc
from services.gateway.errors import ErrorKind, GatewayError
from services.launcher.mesh import Mesh

from .targets import MODEL, leak_problems

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize(("body", "param"), [
    ({**CHAT, "temperature": 10**400}, "temperature"),          # OverflowError in math.isfinite
    ({**CHAT, "top_p": -(10**309)}, "top_p"),
    ({**CHAT, "top_k": 2**31}, "top_k"),                        # ValueError: int32 proto field
    ({**CHAT, "messages": [{"role": [], "content": "x"}]}, "messages[0].role"),   # unhashable role
    ({**CHAT, "messages": [{"role": {"a": 1}, "content": "x"}]}, "messages[0].role"),
    ({**CHAT, "messages": [{"role": "user", "content": "a\ud800b"}]}, "messages[0].content"),  # lone surrogate
    ({**CHAT, "stop": ["\udfff"]}, "stop"),
])
def test_chat_body_rejects_as_400(body: dict, param: str) -> None:
    with pytest.raises(GatewayError) as err:
        parse_chat_body(body)
    assert err.value.kind is ErrorKind.INVALID_REQUEST
    assert err.value.param == param


def test_completion_prompt_with_lone_surrogate_is_400() -> None:
    with pytest.raises(GatewayError) as err:
        parse_completion_body({"model": MODEL, "prompt": "\ud848x"})
    assert err.value.param == "prompt"


def test_error_echoes_a_bounded_value() -> None:
    deep: list = []
    for _ in range(5000):
        deep = [deep]
    with pytest.raises(GatewayError) as err:
        parse_chat_body({**CHAT, "temperature": deep})   # repr() of it would recurse
    assert len(err.value.message) < 300
    with pytest.raises(GatewayError) as err:
        parse_chat_body({**CHAT, "temperature": "x" * 100_000})
    assert len(err.value.message) < 300


@pytest.mark.parametrize("raw", [
    b"[" * 100_000,                              # RecursionError in json.loads
    b'{"a":' * 50_000,
    b"\xff\xfe\x00{",                             # not UTF-8
    json.dumps({"model": MODEL, "prompt": "\ud848\ud81e"}).encode(),   # lone surrogates
])
def test_gateway_answers_400_to_unparseable_bodies(fuzz_mesh: Mesh, raw: bytes) -> None:
    url = fuzz_mesh.endpoints.gateway_http[0] + "/v1/completions"
    resp = httpx.post(url, content=raw, timeout=30, headers={
        "Authorization": f"Bearer {fuzz_mesh.api_key}", "Content-Type": "application/json"})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("path", ["/kvmesh.v1.Engine/GetInfo", "/kvmesh.v1.Engine/Abort",
                                  "/kvmesh.v1.Engine/Generate"])
def test_undecodable_grpc_request_is_invalid_argument(fuzz_mesh: Mesh, path: str) -> None:
    """grpcio answered UNKNOWN "Unexpected DecodeError"; the guard in
    services/common/grpc_guard.py makes it INVALID_ARGUMENT."""
    with grpc.insecure_channel(fuzz_mesh.endpoints.engines[0]) as channel:
        ident = lambda b: b  # noqa: E731
        with pytest.raises(grpc.RpcError) as err:
            if path.endswith("Generate"):
                call = channel.stream_stream(path, request_serializer=ident, response_deserializer=ident)
                list(call(iter([b"\x0f\xd0\x1d"]), timeout=10))
            else:
                call = channel.unary_unary(path, request_serializer=ident, response_deserializer=ident)
                call(b"\x0f\xd0\x1d", timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
        assert "kvmesh.v1." in err.value.details()
        # The engine still serves well-formed calls.
        info = engine_pb2_grpc.EngineStub(channel).GetInfo(engine_pb2.GetInfoRequest(), timeout=10)
        assert info.model == MODEL
    assert leak_problems(fuzz_mesh) == []
