"""The rendered Envoy in front of an in-process fake gateway (aiohttp for
HTTP/SSE, grpc.aio for gRPC): routing, streaming without buffering,
x-request-id, the 413 body limit with an OpenAI error body, the transcoded
SSE bridge and gRPC reflection through Envoy. Real Envoy, free ports."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import ssl
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import grpc
import pytest
from aiohttp import web

from services.common.grpc_server import make_server
from services.common.proto.kvmesh.v1 import inference_pb2, inference_pb2_grpc
from services.edge.render import render_yaml
from services.edge.topology import AdminSpec, GatewayEndpoint, ListenerSpec, Topology
from services.launcher.mesh import envoy_binary
from services.launcher.ports import free_port
from services.tools.devcerts import ensure_dev_certs

ROOT = Path(__file__).resolve().parents[3]
GRPCURL = str(Path(sys.prefix) / "bin" / "grpcurl")
DELTAS = 5


@dataclass
class Seen:
    """What the fake gateway saw, for assertions."""

    http_request_ids: list[str] = field(default_factory=list)
    grpc_metadata: list[dict[str, str]] = field(default_factory=list)
    release: asyncio.Event = field(default_factory=asyncio.Event)


SEEN = web.AppKey("seen", Seen)


class FakeInference(inference_pb2_grpc.InferenceServicer):
    def __init__(self, seen: Seen) -> None:
        self.seen = seen

    async def Chat(self, request: inference_pb2.ChatRequest, context: grpc.aio.ServicerContext):  # noqa: N802 - the proto's method name
        self.seen.grpc_metadata.append(dict(context.invocation_metadata()))  # type: ignore[arg-type]  # grpc-stubs: Optional; a server call always has metadata
        for i in range(DELTAS):
            yield inference_pb2.GenerateEvent(
                request_id="r1", delta=inference_pb2.DeltaEvent(text=f"t{i} ", token_ids=[i])
            )
            await asyncio.sleep(0.02)
        yield inference_pb2.GenerateEvent(
            request_id="r1", finished=inference_pb2.FinishedEvent(finish_reason=1)  # type: ignore[arg-type]  # the proto enum by number, as the wire has it
        )


async def _sse(request: web.Request) -> web.StreamResponse:
    seen = request.app[SEEN]
    seen.http_request_ids.append(request.headers.get("x-request-id", ""))
    await request.read()
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    await resp.write(b'data: {"n": 0}\n\n')
    # Hold the stream until the test has seen the first event through Envoy:
    # proves Envoy forwards events as they come instead of buffering.
    await asyncio.wait_for(seen.release.wait(), timeout=30)
    await resp.write(b'data: {"n": 1}\n\ndata: [DONE]\n\n')
    await resp.write_eof()
    return resp


async def _models(request: web.Request) -> web.Response:
    request.app[SEEN].http_request_ids.append(request.headers.get("x-request-id", ""))
    return web.json_response({"object": "list", "data": []})


async def _health(request: web.Request) -> web.Response:
    return web.Response(text="ok")


@dataclass
class Edge:
    url: str
    grpc_target: str
    seen: Seen
    ca: Path | None = None


async def _wait_ready(url: str, proc: subprocess.Popen[bytes], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "Envoy exited during start-up"
        try:
            ok = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=1).status == 200)
            if ok:
                return
        except OSError:
            pass
        await asyncio.sleep(0.1)
    raise AssertionError(f"Envoy not ready at {url}")


@pytest.fixture
async def edge(tmp_path: Path) -> AsyncIterator[Edge]:
    async with running_edge(tmp_path, Topology()) as started:
        yield started


@contextlib.asynccontextmanager
async def running_edge(tmp_path: Path, base: Topology) -> AsyncIterator[Edge]:
    """The fake gateway and a real Envoy rendered from `base` (ports and
    files filled in at run time)."""
    seen = Seen()
    server, health = make_server(["kvmesh.v1.Inference"])
    inference_pb2_grpc.add_InferenceServicer_to_server(FakeInference(seen), server)
    grpc_port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    await health.set_serving(True)

    app = web.Application()
    app[SEEN] = seen
    app.router.add_get("/health", _health)
    app.router.add_post("/v1/chat/completions", _sse)
    app.router.add_get("/v1/models", _models)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    http_port = site._server.sockets[0].getsockname()[1]  # port-0 bind

    port, admin = free_port(), free_port()
    topology = base.with_ports(
        ListenerSpec(port=port), AdminSpec(port=admin),
        [GatewayEndpoint(http_port=http_port, grpc_port=grpc_port)],
    )
    certs = ensure_dev_certs(tmp_path / "tls") if base.tls.enabled else None
    topology = topology.with_files(ROOT, *((str(certs.cert_chain), str(certs.private_key)) if certs else ()))
    config = tmp_path / "envoy.yaml"
    config.write_text(render_yaml(topology))
    log = open(tmp_path / "envoy.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [envoy_binary(), "-c", str(config), "--use-dynamic-base-id", "--log-level", "warning"],
        cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    try:
        await _wait_ready(f"http://127.0.0.1:{admin}/ready", proc)
        scheme = "https" if certs else "http"
        yield Edge(f"{scheme}://127.0.0.1:{port}", f"127.0.0.1:{port}", seen, certs.ca if certs else None)
    finally:
        seen.release.set()
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()
        await runner.cleanup()
        await server.stop(None)


async def test_sse_streams_through_envoy_event_by_event_with_request_id(edge: Edge) -> None:
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{edge.url}/v1/chat/completions", json={"x": 1},
                                headers={"X-Request-Id": "client-id-0123456789abcdef0123456789"}) as resp:
            assert resp.status == 200
            assert resp.headers["x-request-id"] == "client-id-0123456789abcdef0123456789"
            first = await asyncio.wait_for(resp.content.readline(), timeout=20)
            assert first == b'data: {"n": 0}\n'
            edge.seen.release.set()
            rest = await asyncio.wait_for(resp.content.read(), timeout=20)
    assert b"[DONE]" in rest
    assert edge.seen.http_request_ids == ["client-id-0123456789abcdef0123456789"]


async def test_envoy_generates_a_request_id_when_none_is_sent(edge: Edge) -> None:
    edge.seen.release.set()
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{edge.url}/v1/chat/completions", json={}) as resp:
            await resp.read()
            generated = resp.headers["x-request-id"]
    assert generated and edge.seen.http_request_ids == [generated]


async def test_oversized_body_gets_413_with_openai_error(edge: Edge) -> None:
    body = b'{"pad": "' + b"x" * (1_048_576 + 10) + b'"}'
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{edge.url}/v1/chat/completions", data=body,
                                headers={"Content-Type": "application/json"}) as resp:
            assert resp.status == 413
            error = (await resp.json())["error"]
    assert "larger than 1048576 bytes" in error["message"]
    assert error["type"] == "invalid_request_error"
    assert edge.seen.http_request_ids == []


async def test_healthz_is_answered_by_envoy(edge: Edge) -> None:
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{edge.url}/healthz") as resp:
            assert resp.status == 200


async def test_grpc_stream_and_metadata_through_envoy(edge: Edge) -> None:
    async with grpc.aio.insecure_channel(edge.grpc_target) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        call = stub.Chat(inference_pb2.ChatRequest(model="m"),
                         metadata=[("authorization", "Bearer k1")], timeout=20)
        events = [e async for e in call]
    assert [e.WhichOneof("event") for e in events] == ["delta"] * DELTAS + ["finished"]
    meta = edge.seen.grpc_metadata[0]
    assert meta["authorization"] == "Bearer k1"
    assert meta.get("x-request-id")


async def test_grpcurl_lists_services_through_envoy(edge: Edge) -> None:
    proc = await asyncio.create_subprocess_exec(
        GRPCURL, "-plaintext", edge.grpc_target, "list",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), timeout=30)
    assert proc.returncode == 0, err.decode()
    assert "kvmesh.v1.Inference" in out.decode().split()


async def test_transcoded_chat_is_an_sse_stream(edge: Edge) -> None:
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{edge.url}/v1/chat", json={"model": "m"},
                                headers={"Authorization": "Bearer k2"}) as resp:
            assert resp.status == 200
            text = (await resp.read()).decode()
    events = [json.loads(line[len("data: "):]) for line in text.splitlines() if line.startswith("data: ")]
    assert [("delta" in e) for e in events] == [True] * DELTAS + [False]
    assert "finished" in events[-1]
    assert edge.seen.grpc_metadata[0]["authorization"] == "Bearer k2"


# ---------------------------------------------------------------- page, CORS, limits, TLS


async def test_chat_page_is_served_by_envoy(edge: Edge) -> None:
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{edge.url}/") as resp:
            assert resp.status == 200
            assert resp.headers["content-type"].startswith("text/html")
            assert "script-src 'self'" in resp.headers["content-security-policy"]
            page = await resp.text()
        assert page == (ROOT / "web" / "index.html").read_text()
        async with session.get(f"{edge.url}/chat.js") as resp:
            assert resp.status == 200 and resp.headers["content-type"].startswith("text/javascript")
            assert "/v1/chat" in await resp.text()
    assert edge.seen.http_request_ids == []  # no gateway involved


def _cors_topology() -> Topology:
    topology = Topology()
    topology.cors.allow_origins = ["http://allowed.example:3000"]
    return topology


async def test_cors_preflight_is_answered_only_for_allowed_origins(tmp_path: Path) -> None:
    preflight = {"Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    async with running_edge(tmp_path, _cors_topology()) as edge, aiohttp.ClientSession() as session:
        async with session.options(f"{edge.url}/v1/chat/completions",
                                   headers={**preflight, "Origin": "http://allowed.example:3000"}) as resp:
            assert resp.status == 200
            assert resp.headers["access-control-allow-origin"] == "http://allowed.example:3000"
            assert "authorization" in resp.headers["access-control-allow-headers"]
            assert "POST" in resp.headers["access-control-allow-methods"]
        async with session.options(f"{edge.url}/v1/chat/completions",
                                   headers={**preflight, "Origin": "http://evil.example"}) as resp:
            assert resp.status == 403
            assert "access-control-allow-origin" not in resp.headers
            assert "not in the edge's cors.allow_origins" in (await resp.json())["error"]["message"]
        # A real request from the allowed origin carries the CORS answer headers.
        async with session.get(f"{edge.url}/v1/models", headers={"Origin": "http://allowed.example:3000"}) as resp:
            assert resp.status == 200
            assert resp.headers["access-control-allow-origin"] == "http://allowed.example:3000"
    assert len(edge.seen.http_request_ids) == 1  # preflights never reached the gateway


async def test_local_rate_limit_is_per_api_key(tmp_path: Path) -> None:
    topology = Topology()
    topology.rate_limit.per_key_requests_per_second = 1
    topology.rate_limit.per_key_burst = 5
    async with running_edge(tmp_path, topology) as edge, aiohttp.ClientSession() as session:
        async def get(key: str) -> tuple[int, str, str]:
            async with session.get(f"{edge.url}/v1/models", headers={"Authorization": f"Bearer {key}"}) as resp:
                return resp.status, resp.headers.get("retry-after", ""), await resp.text()

        flood = await asyncio.gather(*(get("flooder") for _ in range(20)))
        statuses = [status for status, _, _ in flood]
        assert statuses.count(200) <= 10 and statuses.count(429) >= 10, statuses
        limited = next(r for r in flood if r[0] == 429)
        assert limited[1] == "1" and json.loads(limited[2])["error"]["type"] == "rate_limit_error"
        # Another key has its own bucket: not starved by the flooder.
        assert [s for s, _, _ in await asyncio.gather(*(get("polite") for _ in range(3)))] == [200] * 3


async def test_local_rate_limit_answers_grpc_with_resource_exhausted(tmp_path: Path) -> None:
    topology = Topology()
    topology.rate_limit.per_key_requests_per_second = 1
    topology.rate_limit.per_key_burst = 1
    async with running_edge(tmp_path, topology) as edge:
        async with grpc.aio.insecure_channel(edge.grpc_target) as channel:
            stub = inference_pb2_grpc.InferenceStub(channel)
            codes = []
            for _ in range(6):
                try:
                    [e async for e in stub.Chat(inference_pb2.ChatRequest(model="m"),
                                                metadata=[("authorization", "Bearer g")], timeout=20)]
                    codes.append(grpc.StatusCode.OK)
                except grpc.aio.AioRpcError as exc:
                    codes.append(exc.code())
    assert grpc.StatusCode.RESOURCE_EXHAUSTED in codes and codes[0] == grpc.StatusCode.OK


async def test_tls_negotiates_h2_for_grpc_and_serves_http11(tmp_path: Path) -> None:
    topology = Topology()
    topology.tls.enabled = True
    async with running_edge(tmp_path, topology) as edge:
        assert edge.ca is not None and edge.url.startswith("https://")
        host, port = edge.grpc_target.split(":")
        for offered, chosen in ((["h2", "http/1.1"], "h2"), (["http/1.1"], "http/1.1")):
            context = ssl.create_default_context(cafile=str(edge.ca))
            context.set_alpn_protocols(offered)
            _, writer = await asyncio.open_connection(host, int(port), ssl=context, server_hostname="localhost")
            try:
                assert writer.get_extra_info("ssl_object").selected_alpn_protocol() == chosen
            finally:
                writer.close()
        credentials = grpc.ssl_channel_credentials(root_certificates=edge.ca.read_bytes())
        async with grpc.aio.secure_channel(edge.grpc_target, credentials) as channel:
            stub = inference_pb2_grpc.InferenceStub(channel)
            events = [e async for e in stub.Chat(inference_pb2.ChatRequest(model="m"), timeout=20)]
        assert events[-1].WhichOneof("event") == "finished"
        context = ssl.create_default_context(cafile=str(edge.ca))
        async with aiohttp.ClientSession() as session:
            async with session.get(f"{edge.url}/healthz", ssl=context) as resp:
                assert resp.status == 200 and resp.version.major == 1
            # Plaintext to a TLS listener does not get through.
            with pytest.raises(aiohttp.ClientError):
                async with session.get(f"http://{edge.grpc_target}/healthz") as resp:
                    await resp.read()
