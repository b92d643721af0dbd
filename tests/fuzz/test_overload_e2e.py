"""Overload and security through the real Envoy (marked e2e).

A mesh with little capacity (2 engines x 2 batch slots, no engine-side
queue, 4 queued P1 and 4 queued P2, room for 64 queued P0) takes a burst of
10x that capacity: every request either runs to the end or gets a fast,
clear 429 + Retry-After (gRPC: RESOURCE_EXHAUSTED + retry-after); every P0
request completes; gateway and scheduler memory stays bounded; nothing
crashes and nothing leaks. Then: internal gRPC services are not reachable
through Envoy, one tenant cannot hijack or cancel another's request by
reusing its request id, and no API key appears in any service's log.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import grpc
import pytest
from _mesh_stop import stop_test_mesh

from services.common.config import ApiKeyConfig, load_config
from services.common.proto.kvmesh.v1 import (
    engine_pb2,
    engine_pb2_grpc,
    inference_pb2,
    inference_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
)
from services.launcher.mesh import Mesh, MeshOptions

from .targets import MODEL, alive_problems, leak_problems, log_problems

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
SLOTS = 2 * 2                    # engines x max_running, engine_queue_slack 0
QUEUE_CAPS = [64, 4, 4]
CAPACITY = SLOTS + QUEUE_CAPS[1] + QUEUE_CAPS[2]
BURST = 10 * CAPACITY            # 120 requests at once
P0_IN_BURST = 16
# RSS growth a burst may leave behind; a leak per request (buffers, tasks,
# mailboxes) of even 100 KB would show as 12 MB here, a cache of bodies more.
RSS_GROWTH_BYTES = 48 * 1024 * 1024
OTHER_KEY = "sk-tenant-b-" + secrets.token_urlsafe(16)


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    if not (ROOT / ".models" / MODEL).is_dir():
        pytest.skip(f".models/{MODEL} is missing: run `make setup`")
    config = load_config(ROOT / "config" / "kvmesh.yaml")
    config.engines.template.max_running = 2
    config.scheduler.engine_queue_slack = 0
    config.scheduler.queue_caps = list(QUEUE_CAPS)
    config.gateway.api_keys.append(ApiKeyConfig(
        sha256=hashlib.sha256(OTHER_KEY.encode()).hexdigest(), tenant="tenant-b", priority_ceiling=0))
    m = Mesh(config, MeshOptions(engines=2, backend="sim", model=MODEL, free_ports=True,
                                 run_dir=tmp_path_factory.mktemp("overload")))
    m.start()
    try:
        yield m
    finally:
        stop_test_mesh(m)


def _rss(mesh: Mesh, name: str) -> int:
    pid = mesh.pid(name)
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {name} (pid {pid})")


@dataclass
class Outcome:
    priority: int
    status: int
    seconds: float
    retry_after: str | None
    finish_reason: str | None
    error_type: str | None


async def _chat(session: aiohttp.ClientSession, mesh: Mesh, priority: int, max_tokens: int = 24,
                key: str | None = None, request_id: str | None = None) -> Outcome:
    headers = {"Authorization": f"Bearer {key or mesh.api_key}", "X-Priority": str(priority)}
    if request_id:
        headers["x-request-id"] = request_id
    body = {"model": MODEL, "max_tokens": max_tokens, "messages": [{"role": "user", "content": f"burst {priority}"}]}
    started = time.monotonic()
    async with session.post(f"{mesh.endpoints.public_http}/v1/chat/completions", json=body, headers=headers) as r:
        data = json.loads(await r.read())
        seconds = time.monotonic() - started
        if r.status == 200:
            return Outcome(priority, 200, seconds, None, data["choices"][0]["finish_reason"], None)
        return Outcome(priority, r.status, seconds, r.headers.get("Retry-After"), None,
                       data.get("error", {}).get("type"))


async def test_burst_of_10x_capacity(mesh: Mesh) -> None:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        for _ in range(3):  # warm up: imports, tokenizer, connection pools
            assert (await _chat(session, mesh, 1)).status == 200
        await asyncio.sleep(0.5)
        rss_before = {n: _rss(mesh, n) for n in ("gateway-0", "scheduler")}
        priorities = [0] * P0_IN_BURST + [1, 2] * ((BURST - P0_IN_BURST) // 2)
        outcomes = await asyncio.gather(*(_chat(session, mesh, p) for p in priorities))
    assert len(outcomes) == BURST

    unexpected = [o for o in outcomes if o.status not in (200, 429)]
    assert unexpected == [], "only 200 or 429 under overload"
    done = [o for o in outcomes if o.status == 200]
    rejected = [o for o in outcomes if o.status == 429]
    assert all(o.finish_reason == "length" for o in done), "every admitted request ran to the end"
    assert rejected, "a 10x burst must be refused in part"
    assert all(o.retry_after and int(o.retry_after) >= 1 and o.error_type == "rate_limit_error"
               for o in rejected), "429s carry Retry-After and an OpenAI rate_limit_error"
    p0 = [o for o in outcomes if o.priority == 0]
    assert all(o.status == 200 for o in p0), "every P0 request of the burst is served"
    # Rejections are answered at admission, not after waiting in a queue.
    assert max(o.seconds for o in rejected) < max(o.seconds for o in done)

    await asyncio.sleep(0.5)
    assert leak_problems(mesh) == []
    for name, before in rss_before.items():
        growth = _rss(mesh, name) - before
        assert growth < RSS_GROWTH_BYTES, f"{name} RSS grew by {growth / 2**20:.1f} MiB in one burst"
    assert alive_problems(mesh) == []


async def test_grpc_burst_gets_resource_exhausted(mesh: Mesh) -> None:
    md = (("authorization", f"Bearer {mesh.api_key}"),)

    async def one(stub: inference_pb2_grpc.InferenceStub) -> tuple[grpc.StatusCode, str | None]:
        call = stub.Chat(inference_pb2.ChatRequest(
            model=MODEL, messages=[inference_pb2.ChatMessage(role="user", content="grpc burst")],
            priority=inference_pb2.PRIORITY_P2), metadata=md, timeout=60)
        try:
            async for _ in call:
                pass
        except grpc.aio.AioRpcError as err:
            trailers = dict(err.trailing_metadata() or ())
            return err.code(), trailers.get("retry-after")
        return grpc.StatusCode.OK, None

    async with grpc.aio.insecure_channel(mesh.endpoints.public_grpc) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        results = await asyncio.gather(*(one(stub) for _ in range(4 * CAPACITY)))
    codes = {code for code, _ in results}
    assert codes <= {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}, codes
    assert grpc.StatusCode.OK in codes and grpc.StatusCode.RESOURCE_EXHAUSTED in codes
    assert all(ra for code, ra in results if code == grpc.StatusCode.RESOURCE_EXHAUSTED)
    assert leak_problems(mesh) == []


@pytest.mark.parametrize(("path", "request_message", "reply"), [
    ("/kvmesh.v1.Scheduler/GetState", scheduler_pb2.GetStateRequest(), scheduler_pb2.SchedulerState),
    ("/kvmesh.v1.Engine/GetInfo", engine_pb2.GetInfoRequest(), engine_pb2.EngineInfo),
    ("/kvmesh.v1.Engine/Abort", engine_pb2.AbortRequest(request_id="anyone"), engine_pb2.AbortResponse),
])
def test_internal_services_are_not_reachable_through_envoy(
    mesh: Mesh, path: str, request_message: object, reply: type
) -> None:
    with grpc.insecure_channel(mesh.endpoints.public_grpc) as channel:
        call = channel.unary_unary(path, request_serializer=lambda m: m.SerializeToString(),
                                   response_deserializer=reply.FromString)
        with pytest.raises(grpc.RpcError) as err:
            call(request_message, timeout=10, metadata=(("authorization", f"Bearer {mesh.api_key}"),))
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED, err.value.details()
        # The public API on the same listener works.
        models = inference_pb2_grpc.InferenceStub(channel).ListModels(
            inference_pb2.ListModelsRequest(), timeout=10,
            metadata=(("authorization", f"Bearer {mesh.api_key}"),))
        assert MODEL in [m.id for m in models.models]
    # Admit (a stream) is refused too, so no lease can be taken from outside.
    with grpc.insecure_channel(mesh.endpoints.public_grpc) as channel:
        admit = scheduler_pb2_grpc.SchedulerStub(channel).Admit(iter([scheduler_pb2.AdmitClientMessage(
            request=scheduler_pb2.AdmitRequest(request_id="x", model=MODEL, tenant="t", prompt_tokens=1,
                                               max_tokens=1))]), timeout=10)
        with pytest.raises(grpc.RpcError) as err:
            list(admit)
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
    # And directly on loopback the engine still answers (it is internal, not dead).
    with grpc.insecure_channel(mesh.endpoints.engines[0]) as channel:
        assert engine_pb2_grpc.EngineStub(channel).GetInfo(engine_pb2.GetInfoRequest(), timeout=10).model == MODEL


async def test_tenant_cannot_hijack_or_cancel_another_tenants_request(mesh: Mesh) -> None:
    """Tenant B reuses tenant A's x-request-id while A's request runs: B is
    refused (4xx), A's request runs to the end untouched."""
    request_id = "shared-" + secrets.token_hex(4)
    async with aiohttp.ClientSession() as session:
        a_task = asyncio.create_task(_chat(session, mesh, 0, max_tokens=300, request_id=request_id))
        deadline = time.monotonic() + 30
        async with grpc.aio.insecure_channel(mesh.endpoints.scheduler) as channel:
            stub = scheduler_pb2_grpc.SchedulerStub(channel)
            while (await stub.GetState(scheduler_pb2.GetStateRequest(), timeout=10)).leases_total == 0:
                assert time.monotonic() < deadline, "A's request never started"
                await asyncio.sleep(0.02)
        b_http = await _chat(session, mesh, 0, max_tokens=4, key=OTHER_KEY, request_id=request_id)
        async with grpc.aio.insecure_channel(mesh.endpoints.public_grpc) as channel:
            call = inference_pb2_grpc.InferenceStub(channel).Chat(
                inference_pb2.ChatRequest(model=MODEL, messages=[inference_pb2.ChatMessage(role="user", content="b")]),
                metadata=(("authorization", f"Bearer {OTHER_KEY}"), ("x-request-id", request_id)), timeout=30)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in call:
                    pass
        a = await a_task
    assert 400 <= b_http.status < 500, b_http
    assert err.value.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.ALREADY_EXISTS)
    assert a.status == 200 and a.finish_reason == "length", a
    assert leak_problems(mesh) == []


async def test_api_keys_never_appear_in_logs(mesh: Mesh) -> None:
    wrong = "sk-wrong-" + secrets.token_urlsafe(16)
    async with aiohttp.ClientSession() as session:
        assert (await _chat(session, mesh, 1, key=OTHER_KEY)).status == 200
        assert (await _chat(session, mesh, 1, key=wrong)).status == 401
        async with session.get(f"{mesh.endpoints.public_http}/v1/models",
                               headers={"Authorization": f"Bearer {wrong}"}) as r:
            assert r.status == 401
    with grpc.insecure_channel(mesh.endpoints.public_grpc) as channel:
        with pytest.raises(grpc.RpcError):
            inference_pb2_grpc.InferenceStub(channel).ListModels(
                inference_pb2.ListModelsRequest(), timeout=10, metadata=(("authorization", f"Bearer {wrong}"),))
    await asyncio.sleep(0.5)  # let Envoy's access log and the services flush
    logs = sorted(mesh.log_dir.glob("*.log"))
    assert {p.stem for p in logs} >= {"scheduler", "gateway-0", "envoy", "engine-0"}
    for path in logs:
        text = path.read_text(errors="replace")
        for key in (mesh.api_key, OTHER_KEY, wrong):
            assert key not in text, f"an API key appears in {path.name}"
    assert log_problems(mesh) == []
    assert alive_problems(mesh) == []
