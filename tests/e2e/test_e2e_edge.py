"""The edge through the real mesh (scheduler, two sim engines, a gateway,
Envoy): the gRPC-JSON SSE bridge, CORS, the per-key rate limit, the body
limit and x-request-id end to end (the chat page: test_e2e_browser.py)."""

from __future__ import annotations

import asyncio
import json
import time
import uuid

import aiohttp
import grpc
from _streams import engine_infos as _engine_infos
from _streams import eventually as _eventually

from services.common.proto.kvmesh.v1 import engine_pb2, engine_pb2_grpc
from services.launcher.mesh import Mesh

MODEL = "tiny-llama"
MESH_TOPOLOGY = "tests/e2e/topology-e2e.yaml"
ALLOWED_ORIGIN = "http://allowed.example:3000"


def _auth(mesh: Mesh) -> dict[str, str]:
    return {"Authorization": f"Bearer {mesh.api_key}"}


def _engines_idle(mesh: Mesh) -> bool:
    return all(i.running == 0 and i.blocks_used == 0 for i in _engine_infos(mesh))


async def _sse_events(resp: aiohttp.ClientResponse) -> list[tuple[float, dict]]:
    """Each `data:` event with the time it arrived."""
    events: list[tuple[float, dict]] = []
    while True:
        line = await asyncio.wait_for(resp.content.readline(), timeout=60)
        if not line:
            return events
        if line.startswith(b"data:"):
            events.append((time.monotonic(), json.loads(line[len(b"data:"):])))


# ---------------------------------------------------------------- SSE bridge


async def test_transcoded_generate_streams_events_one_by_one(e2e_mesh: Mesh) -> None:
    body = {"model": MODEL, "prompt": "Once upon a time", "sampling": {"max_tokens": 120}}
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{e2e_mesh.endpoints.public_http}/v1/generate", json=body,
                                headers=_auth(e2e_mesh)) as resp:
            assert resp.status == 200, await resp.text()
            events = await _sse_events(resp)
    kinds = [next(k for k in ("queued", "delta", "finished", "heartbeat") if k in e) for _, e in events]
    assert kinds[-1] == "finished" and kinds.count("finished") == 1
    assert events[-1][1]["finished"]["usage"]["completionTokens"] == 120
    deltas = [t for (t, _), k in zip(events, kinds, strict=True) if k == "delta"]
    assert len(deltas) >= 5
    # Event by event, not one burst at the end: the deltas arrived at many
    # distinct moments spread over the generation.
    assert len({round(t, 3) for t in deltas}) >= 5
    assert deltas[-1] - deltas[0] > 0.05
    text = "".join(e["delta"]["text"] for _, e in events if "delta" in e)
    assert text


async def test_transcoded_generate_get_with_query_parameters(e2e_mesh: Mesh) -> None:
    url = (f"{e2e_mesh.endpoints.public_http}/v1/generate?model={MODEL}&prompt=Hello"
           "&sampling.max_tokens=8&priority=PRIORITY_P0")
    async with aiohttp.ClientSession() as session:
        async with session.get(url, headers=_auth(e2e_mesh)) as resp:
            assert resp.status == 200, await resp.text()
            events = [e for _, e in await _sse_events(resp)]
    assert "finished" in events[-1]
    assert sum(len(e["delta"].get("tokenIds", [])) for e in events if "delta" in e) == 8


async def test_transcoded_errors_are_http_statuses(e2e_mesh: Mesh) -> None:
    body = {"model": "no-such-model", "prompt": "x"}
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{e2e_mesh.endpoints.public_http}/v1/generate", json=body,
                                headers=_auth(e2e_mesh)) as resp:
            assert 400 <= resp.status < 500
            assert (await resp.json(content_type=None))["message"]
        async with session.post(f"{e2e_mesh.endpoints.public_http}/v1/generate", json={"model": MODEL}) as resp:
            assert resp.status == 401


# ---------------------------------------------------------------- CORS, limits


async def test_cors_preflight_allowed_origin_answered_other_refused(e2e_mesh: Mesh) -> None:
    preflight = {"Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    url = f"{e2e_mesh.endpoints.public_http}/v1/chat/completions"
    async with aiohttp.ClientSession() as session:
        async with session.options(url, headers={**preflight, "Origin": ALLOWED_ORIGIN}) as resp:
            assert resp.status == 200
            assert resp.headers["access-control-allow-origin"] == ALLOWED_ORIGIN
            assert "authorization" in resp.headers["access-control-allow-headers"].lower()
        async with session.options(url, headers={**preflight, "Origin": "http://other.example"}) as resp:
            assert resp.status == 403
            assert "access-control-allow-origin" not in resp.headers


async def test_local_rate_limit_answers_429_per_key(e2e_mesh: Mesh) -> None:
    url = f"{e2e_mesh.endpoints.public_http}/v1/models"
    async with aiohttp.ClientSession() as session:
        async def get(key: str) -> int:
            async with session.get(url, headers={"Authorization": f"Bearer {key}"}) as resp:
                await resp.read()
                return resp.status

        flood = await asyncio.gather(*(get("not-a-real-key") for _ in range(120)))
        # Burst 40 + 20/s: most of a 120-request flood is refused by Envoy
        # (429); what gets through meets the gateway's auth (401).
        assert flood.count(429) >= 30, flood
        assert set(flood) <= {401, 429}
        # The real key has its own bucket.
        assert await get(e2e_mesh.api_key) == 200


async def test_two_megabyte_body_gets_413(e2e_mesh: Mesh) -> None:
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x" * 2_000_000}]})
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{e2e_mesh.endpoints.public_http}/v1/chat/completions", data=body,
                                headers={**_auth(e2e_mesh), "Content-Type": "application/json"}) as resp:
            assert resp.status == 413
            error = (await resp.json(content_type=None))["error"]
    assert "larger than 1048576 bytes" in error["message"]


# ---------------------------------------------------------------- x-request-id


async def test_request_id_reaches_every_service(e2e_mesh: Mesh) -> None:
    await _eventually(lambda: _engines_idle(e2e_mesh), 30, "idle engines")
    request_id = f"e2e-{uuid.uuid4().hex}"
    body = {"model": MODEL, "stream": True, "max_tokens": 1500,
            "messages": [{"role": "user", "content": "A long story, please."}]}
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{e2e_mesh.endpoints.public_http}/v1/chat/completions", json=body,
                                headers={**_auth(e2e_mesh), "X-Request-Id": request_id}) as resp:
            assert resp.status == 200
            assert resp.headers["x-request-id"] == request_id
            event_id = await asyncio.wait_for(resp.content.readline(), timeout=60)
            assert event_id == f"id: {request_id}.0\n".encode()  # the resume point (README)
            first = await asyncio.wait_for(resp.content.readline(), timeout=60)
            assert first.startswith(b"data:")
            assert request_id in json.loads(first[len(b"data:"):])["id"]

            # The engine knows the request by the client's id: aborting it by that id finds it.
            def abort_everywhere() -> list[bool]:
                found = []
                for address in e2e_mesh.endpoints.engines:
                    with grpc.insecure_channel(address) as channel:
                        found.append(engine_pb2_grpc.EngineStub(channel).Abort(
                            engine_pb2.AbortRequest(request_id=request_id), timeout=5).found)
                return found

            assert sum(await asyncio.to_thread(abort_everywhere)) == 1
    await _eventually(lambda: _engines_idle(e2e_mesh), 30, "the engine to free the aborted request")
    # The same id in every service's log: gateway, scheduler (placement) and
    # the one engine that ran it.
    assert request_id in (e2e_mesh.log_dir / "gateway-0.log").read_text()
    assert f"request {request_id} placed on" in (e2e_mesh.log_dir / "scheduler.log").read_text()
    engine_logs = [p.read_text() for p in sorted(e2e_mesh.log_dir.glob("engine-*.log"))]
    assert sum(f"request {request_id} started" in log for log in engine_logs) == 1

    def in_access_log() -> bool:
        for line in (e2e_mesh.log_dir / "envoy.log").read_text().splitlines():
            if line.startswith("{") and json.loads(line).get("request_id") == request_id:
                return True
        return False

    # Envoy writes the access log line when the stream ends.
    await _eventually(in_access_log, 30, "Envoy's JSON access log line")
