"""VllmBackend's request loop over a fake AsyncLLM (no vLLM needed): how
vLLM's outputs, its end of stream and its errors become kvmesh outputs;
and the engine arguments (the batch with its P0 headroom).
The real engine is exercised by tests/vllm/test_vllm_backend.py."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from services.common.config import EngineConfig, MeshConfig, ModelConfig
from services.common.finish_reason import FinishReason
from services.engine.backend import EngineDead, GenerationRequest, InvalidRequest, Sampling
from services.engine.vllm_backend import VllmBackend
from services.engine.vllm_backend.launch import engine_args, resolved_info
from services.engine.vllm_backend.vllm_api import VllmApi


class ClientError(Exception):
    pass


class EngineDeadError(Exception):
    """vLLM's, raised for every live request when its engine core dies."""


def completion(ids: list[int], reason: str | None = None) -> SimpleNamespace:
    inner = SimpleNamespace(token_ids=ids, text="t" * len(ids), logprobs=None, finish_reason=reason)
    return SimpleNamespace(num_cached_tokens=0, outputs=[inner], finished=reason is not None)


class FakeLlm:
    """Plays a script: RequestOutputs, then an exception or the end of stream."""

    def __init__(self, script: list[Any]) -> None:
        self.script = script
        self.closed = False
        self.errored = False  # AsyncLLM.errored: its engine core is dead
        self.shut_down = False

    def get_num_queued_tokens(self) -> int:
        return 0

    def shutdown(self, timeout: float) -> None:
        self.shut_down = True

    def generate(self, prompt: Any, params: Any, rid: str, priority: int) -> AsyncIterator[Any]:
        async def stream() -> AsyncIterator[Any]:
            try:
                for item in self.script:
                    if isinstance(item, Exception):
                        raise item
                    yield item
            finally:
                self.closed = True
        return stream()


def backend(script: list[Any]) -> tuple[VllmBackend, FakeLlm]:
    config = MeshConfig(models=[ModelConfig(name="m", path="/nonexistent")])
    b = VllmBackend(config, EngineConfig(backend="vllm", model="m"))
    llm = FakeLlm(script)
    b._llm = llm
    b._api = VllmApi(async_llm=None, engine_args=None, kv_events_config=None, structured_outputs_config=dict,
                     tokens_prompt=dict, sampling_params=lambda **kw: kw, structured_outputs=dict, delta="delta",
                     kv_event_batch=None, client_error=ClientError, engine_dead=EngineDeadError)
    return b, llm


async def run(b: VllmBackend) -> list[Any]:
    request = GenerationRequest("r", [1, 2, 3], Sampling(max_tokens=4))
    return [out async for out in b.generate(request)]


@pytest.mark.parametrize(("script", "reasons"), [
    ([completion([5]), completion([6], "length")], [None, FinishReason.LENGTH]),
    ([completion([5]), completion([6], "repetition")], [None, FinishReason.ERROR]),
    ([completion([5])], [None, FinishReason.ABORT]),  # vLLM ends an aborted stream silently
    ([completion([5]), ClientError("bad")], [None, FinishReason.ERROR]),
    ([completion([5]), RuntimeError("internal")], [None, FinishReason.ERROR]),  # this request's failure
])
async def test_outputs_end_with_one_finish(script: list[Any], reasons: list[Any]) -> None:
    b, _ = backend(script)
    outs = await run(b)
    assert [o.finish_reason for o in outs] == reasons
    assert outs[-1].completion_tokens == len(outs[0].token_ids) + len(outs[-1].token_ids)
    assert b.load().request_ids == []


async def test_a_client_error_before_any_output_is_invalid_request() -> None:
    b, llm = backend([ClientError("prompt too long")])
    with pytest.raises(InvalidRequest, match="too long"):
        await run(b)
    assert llm.closed and b.load().request_ids == []


async def test_a_dead_engine_core_is_the_engines_failure_not_the_requests() -> None:
    b, llm = backend([completion([5]), EngineDeadError("EngineCore encountered an issue")])
    request = GenerationRequest("r", [1, 2, 3], Sampling(max_tokens=4))
    stream = b.generate(request)
    assert (await anext(stream)).token_ids == [5]
    with pytest.raises(EngineDead, match="engine core or its worker died"):
        await anext(stream)
    assert llm.closed and b.load().request_ids == []
    assert b.dead_reason() is None
    llm.errored = True  # vLLM's monitor saw the core process exit
    assert "engine core or its worker died" in (b.dead_reason() or "")


async def test_closing_early_closes_vllms_stream() -> None:
    b, llm = backend([completion([5]), completion([6]), completion([7], "length")])
    stream = b.generate(GenerationRequest("r", [1], Sampling(max_tokens=4)))
    await anext(stream)
    assert b.load().request_ids == ["r"]
    await stream.aclose()
    assert llm.closed and b.load().request_ids == []


def test_vllms_batch_has_the_p0_headroom_and_the_engine_advertises_max_running() -> None:
    engine = EngineConfig(backend="vllm", model="m", p0_headroom=3)
    engine.vllm.max_num_seqs = 16
    api = VllmApi(async_llm=None, engine_args=lambda **kw: kw, kv_events_config=None, tokens_prompt=dict,
                  structured_outputs_config=dict, sampling_params=dict, structured_outputs=dict,
                  delta="delta", kv_event_batch=None, client_error=ClientError,
                  engine_dead=EngineDeadError)
    args = engine_args(api, engine, Path("/m"), "m", 0, None, None)
    assert args["max_num_seqs"] == 19 and args["scheduling_policy"] == "priority"

    llm = SimpleNamespace(vllm_config=SimpleNamespace(
        cache_config=SimpleNamespace(block_size=16, num_gpu_blocks=100),
        model_config=SimpleNamespace(max_model_len=2048, get_vocab_size=lambda: 1000),
        scheduler_config=SimpleNamespace(max_num_seqs=19)))
    info = resolved_info(llm, "m", 16, p0_headroom=3)
    assert (info.max_running, info.p0_headroom) == (16, 3)
