"""Streams through a real gateway process: backpressure and disconnects.

One mesh of real processes for the module -- scheduler, one zero-cost sim
engine (`speed_factor 0`: tokens come as fast as the engine's Python loop
runs), one gateway, no Envoy -- on free ports.

- A slow reader (one byte per 100 ms, with a small receive window) of a long
  stream gets every token exactly once, while the gateway's memory stays flat:
  the engine coalesces what the gateway cannot pass on (the chunks the client
  finally gets are few and large) instead of the gateway buffering it.
- A client that leaves mid-stream: the engine sees the cancel (its running
  count drops, its abort counter rises) within moments; the time is printed.

The sim is deterministic (a token's text depends only on its id, the next
token only on all tokens before it), so the text a direct `Engine.Generate`
returns for the same prompt ids is the exact expected stream: a token lost or
repeated would change it.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from _mesh_stop import stop_test_mesh

from services.common.config import MeshConfig, load_config
from services.common.proto.kvmesh.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from services.launcher.mesh import Mesh, MeshOptions

from ._support import MODEL, ROOT

pytestmark = pytest.mark.e2e

# Long enough that, unthrottled, the gateway would hold tens of MB for a slow
# reader (~600 bytes of Python objects + SSE per single-token delta).
LONG_TOKENS = 60_000
PROMPT_IDS = [100 + (7 * i) % 5000 for i in range(48)]
READ_INTERVAL = 0.1
# Generous bounds: they tell "bounded" from "buffers the stream", not speed.
RSS_GROWTH_LIMIT_MB = 20.0
CANCEL_SEEN_LIMIT_SECONDS = 5.0
WAIT_SECONDS = 60.0


def _tune(config: MeshConfig) -> None:
    config.engines.template.sim.speed_factor = 0.0
    # The reference generations (_direct) go straight to the engine, with no
    # lease: lease fencing ends such a generation (UNAVAILABLE "fenced") once
    # it outlives the scheduler's start-up grace (10 s) -- every time on a
    # loaded machine, where setup alone took longer. Nothing here tests fencing.
    config.fencing.enabled = False
    for model in config.models:
        if model.name == MODEL:
            model.max_model_len = 65_536  # the sim needs no position embeddings


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    if not (ROOT / ".models" / MODEL).is_dir():
        pytest.skip(f".models/{MODEL} is missing: run `make setup`")
    config = load_config(ROOT / "config" / "kvmesh.yaml")
    _tune(config)
    started = Mesh(config, MeshOptions(engines=1, backend="sim", model=MODEL, free_ports=True, envoy=False,
                                       run_dir=tmp_path_factory.mktemp("gwstreams")))
    started.start()
    try:
        yield started
    finally:
        stop_test_mesh(started)


# ---------------------------------------------------------------- helpers


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def _engine_metric(mesh: Mesh, name: str, label: str = "") -> float:
    port = mesh.config.engine_config(0).metrics_port
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") and label in line)


async def _direct(mesh: Mesh, ids: list[int], max_tokens: int) -> tuple[list[int], str]:
    """The reference: the engine's own answer for these prompt ids."""
    async with grpc.aio.insecure_channel(mesh.endpoints.engines[0]) as channel:
        call = engine_pb2_grpc.EngineStub(channel).Generate()
        await call.write(engine_pb2.EngineGenerateMessage(request=engine_pb2.EngineRequest(
            request_id=f"ref-{uuid.uuid4().hex}", prompt_token_ids=ids, priority=1,
            sampling=common_pb2.SamplingParams(max_tokens=max_tokens))))
        tokens: list[int] = []
        texts: list[str] = []
        while True:
            event = await call.read()
            assert event is not grpc.aio.EOF, "the engine ended the reference stream early"
            if event.HasField("finished"):
                break
            tokens.extend(event.delta.token_ids)
            texts.append(event.delta.text)
        await call.done_writing()
    return tokens, "".join(texts)


def _open_stream(mesh: Mesh, max_tokens: int, rcvbuf: int | None = None) -> socket.socket:
    """A raw HTTP/1.1 streamed completion; returns the connected socket."""
    host, port = mesh.endpoints.gateway_http[0].removeprefix("http://").rsplit(":", 1)
    body = json.dumps({"model": MODEL, "prompt": PROMPT_IDS, "max_tokens": max_tokens, "stream": True,
                       "stream_options": {"include_usage": True}}).encode()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)  # a small window: backpressure at once
    sock.connect((host, int(port)))
    sock.sendall(
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {mesh.api_key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
    sock.settimeout(WAIT_SECONDS)
    return sock


def _dechunk(raw: bytes) -> bytes:
    """The body of a chunked HTTP/1.1 response."""
    head, _, rest = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head[:200]
    assert b"transfer-encoding: chunked" in head.lower(), head
    out = bytearray()
    while True:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            return bytes(out)
        out += rest[:size]
        rest = rest[size + 2:]


def _sse_events(body: bytes) -> list[dict]:
    events = []
    for block in body.split(b"\n\n"):
        for line in block.split(b"\n"):  # an `id:` line (resume point) may come first
            if line.startswith(b"data: {"):
                events.append(json.loads(line[6:]))
    assert body.rstrip().endswith(b"data: [DONE]"), body[-300:]
    return events


# ---------------------------------------------------------------- tests


async def test_slow_reader_gets_every_token_once_with_flat_gateway_memory(mesh: Mesh) -> None:
    expected_ids, expected_text = await _direct(mesh, PROMPT_IDS, LONG_TOKENS)
    assert len(expected_ids) == LONG_TOKENS
    gateway_pid = mesh.pid("gateway-0")
    assert gateway_pid is not None
    generated_before = _engine_metric(mesh, "vllm:generation_tokens_total")

    def slow_then_fast() -> tuple[bytes, float, float, int, float]:
        sock = _open_stream(mesh, LONG_TOKENS, rcvbuf=4096)
        raw = bytearray(sock.recv(1))  # the stream is on
        rss_start = rss_peak = _rss_mb(gateway_pid)
        slow_started = time.monotonic()
        # One byte per 100 ms until the engine has generated the whole answer
        # (it cannot wait for us: it coalesces), and for at least 3 s.
        while True:
            time.sleep(READ_INTERVAL)
            raw += sock.recv(1)
            rss_peak = max(rss_peak, _rss_mb(gateway_pid))
            slow = time.monotonic() - slow_started
            done = _engine_metric(mesh, "vllm:generation_tokens_total") - generated_before >= LONG_TOKENS
            if (done and slow >= 3.0) or slow > WAIT_SECONDS:
                break
        slow_bytes = len(raw)
        while not raw.endswith(b"0\r\n\r\n"):  # now read the rest at full speed
            piece = sock.recv(1 << 16)
            assert piece, "the gateway closed the stream early"
            raw += piece
        sock.close()
        return bytes(raw), rss_start, rss_peak, slow_bytes, slow

    raw, rss_start, rss_peak, slow_bytes, slow_seconds = await asyncio.to_thread(slow_then_fast)
    events = _sse_events(_dechunk(raw))
    text = "".join(c["text"] for e in events for c in e["choices"])
    usage = next(e["usage"] for e in events if e.get("usage"))
    content_chunks = sum(1 for e in events for c in e["choices"] if c["text"])
    print(f"\nslow reader: {slow_seconds:.1f} s at 1 byte/100 ms ({slow_bytes} bytes) while the engine "
          f"generated {LONG_TOKENS} tokens; gateway RSS {rss_start:.1f} -> peak {rss_peak:.1f} MB; "
          f"{content_chunks} SSE chunks for {usage['completion_tokens']} tokens")
    assert usage["completion_tokens"] == LONG_TOKENS
    assert text == expected_text  # every token, in order, exactly once
    assert events[-1]["choices"] == [] and events[-2]["choices"][0]["finish_reason"] == "length"
    # Coalesced upstream: far fewer chunks than tokens (one per token if the
    # gateway had buffered the engine's per-step deltas for us).
    assert content_chunks < LONG_TOKENS // 10
    assert rss_peak - rss_start < RSS_GROWTH_LIMIT_MB


async def test_engine_sees_the_cancel_soon_after_the_client_leaves(mesh: Mesh) -> None:
    aborted_before = _engine_metric(mesh, "vllm:request_success_total", 'finished_reason="abort"')
    async with grpc.aio.insecure_channel(mesh.endpoints.engines[0]) as channel:
        engine = engine_pb2_grpc.EngineStub(channel)

        async def running() -> int:
            return (await engine.GetInfo(engine_pb2.GetInfoRequest(), timeout=10)).running

        deadline = time.monotonic() + WAIT_SECONDS
        while await running():
            assert time.monotonic() < deadline, "the engine never went idle before the test"
            await asyncio.sleep(0.05)
        sock = await asyncio.to_thread(_open_stream, mesh, LONG_TOKENS)
        got = b""
        while got.count(b"data: {") < 3:  # tokens are flowing
            got += await asyncio.to_thread(sock.recv, 4096)
        assert await running() == 1
        left = time.monotonic()
        sock.close()  # the client goes away mid-stream
        while await running():
            assert time.monotonic() - left < WAIT_SECONDS, "the engine never saw the cancel"
        seen = time.monotonic() - left
    print(f"\nengine saw the cancel {seen * 1000:.1f} ms after the client left")
    aborted = _engine_metric(mesh, "vllm:request_success_total", 'finished_reason="abort"')
    assert aborted == aborted_before + 1  # an abort, not the stream running to its end
    assert seen < CANCEL_SEEN_LIMIT_SECONDS
