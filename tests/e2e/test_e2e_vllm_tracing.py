"""Tracing on real vLLM: the engine passes its span's context to vLLM
(`trace_headers`) and sets vLLM's own `otlp_traces_endpoint`, so vLLM's
`llm_request` span lands in the request's trace, below `engine.generate`.
On the one-engine tiny-llama mesh the run shares (tests/e2e/conftest.py
`shared_tiny_one`, which traces to TINY_ONE_TRACE_PORT: a mesh of its own
cost a vLLM boot, ~80 s); an in-process OTLP receiver (oteltap) listens
there for this test."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from _spans import Spans, attrs
from _vllm_mesh import MODEL, TINY_ONE_TRACE_PORT, SharedVllmMesh

from services.launcher.mesh import Mesh

oteltap = pytest.importorskip("oteltap", reason="oteltap (the test OTLP receiver) is not installed")

pytestmark = [pytest.mark.vllm, pytest.mark.e2e]


@pytest.fixture(scope="module")
def vllm_mesh(shared_tiny_one: SharedVllmMesh, tmp_path_factory: pytest.TempPathFactory) -> Mesh:
    # One plain request: it holds under whatever scheduler settings the
    # previous module of this mesh left (no scheduler restart).
    mesh = shared_tiny_one.get(tmp_path_factory, any_scheduler=True).mesh
    assert mesh.config.tracing.otlp_endpoint == f"http://127.0.0.1:{TINY_ONE_TRACE_PORT}"
    return mesh


async def test_vllm_span_continues_the_engine_span(vllm_mesh: Mesh) -> None:
    request_id = "trace-e2e-vllm-1"
    settings = oteltap.OtelTapHttpProtobufReceiverSettings(http_port=TINY_ONE_TRACE_PORT)
    async with oteltap.OtelTapHttpProtobufReceiver(settings) as tap:
        spans = Spans()
        collector = asyncio.create_task(spans.collect(tap))
        try:
            body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
            headers = {"Authorization": f"Bearer {vllm_mesh.api_key}", "x-request-id": request_id}
            async with aiohttp.ClientSession() as session:
                async with session.post(f"{vllm_mesh.endpoints.public_http}/v1/chat/completions", json=body,
                                        headers=headers, timeout=aiohttp.ClientTimeout(total=120)) as resp:
                    assert resp.status == 200, await resp.text()
            trace = await spans.wait_for(request_id, timeout=90, also=("llm_request",))
        finally:
            collector.cancel()
    (generate,) = [s for s in trace if s.name == "engine.generate"]
    (vllm,) = [s for s in trace if s.name == "llm_request"]
    assert vllm.parent_span_id == generate.span_id  # vLLM continues the engine's span
    assert attrs(vllm).get("gen_ai.request.id") == request_id
    assert attrs(vllm).get("gen_ai.usage.completion_tokens") == attrs(generate)["gen_ai.usage.output_tokens"]
