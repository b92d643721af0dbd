"""The part of vLLM's API the adapter uses, imported once by `import_vllm()`.

Importing vLLM takes 13-16 s, so no module of this package imports it at
load time: `VllmBackend.start()` calls `import_vllm()` in a thread and hands
the resulting `VllmApi` record to the modules that need a vLLM name. That
record is therefore the whole list of vLLM names kvmesh depends on (checked
against vLLM 0.32).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

__all__ = ["VllmApi", "import_vllm"]


@dataclass(frozen=True)
class VllmApi:
    async_llm: Any           # vllm.v1.engine.async_llm.AsyncLLM
    engine_args: Any         # vllm.engine.arg_utils.AsyncEngineArgs
    kv_events_config: Any    # vllm.config.KVEventsConfig
    structured_outputs_config: Any  # vllm.config.StructuredOutputsConfig
    tokens_prompt: Any       # vllm.inputs.TokensPrompt
    sampling_params: Any     # vllm.sampling_params.SamplingParams
    structured_outputs: Any  # vllm.sampling_params.StructuredOutputsParams
    delta: Any               # RequestOutputKind.DELTA: each output carries only new tokens
    kv_event_batch: Any      # vllm.distributed.kv_events.KVEventBatch (ZMQ payload type)
    client_error: type[Exception]  # vllm.exceptions.VLLMClientError: the request's fault
    # vllm.v1.engine.exceptions.EngineDeadError: the engine core or its worker died (every
    # live request gets it): the engine's failure, not the request's.
    engine_dead: type[Exception]


def import_vllm() -> VllmApi:
    """Import vLLM (slow: call it off the event loop)."""
    sampling = importlib.import_module("vllm.sampling_params")
    return VllmApi(
        async_llm=importlib.import_module("vllm.v1.engine.async_llm").AsyncLLM,
        engine_args=importlib.import_module("vllm.engine.arg_utils").AsyncEngineArgs,
        kv_events_config=importlib.import_module("vllm.config").KVEventsConfig,
        structured_outputs_config=importlib.import_module("vllm.config").StructuredOutputsConfig,
        tokens_prompt=importlib.import_module("vllm.inputs").TokensPrompt,
        sampling_params=sampling.SamplingParams,
        structured_outputs=sampling.StructuredOutputsParams,
        delta=sampling.RequestOutputKind.DELTA,
        kv_event_batch=importlib.import_module("vllm.distributed.kv_events").KVEventBatch,
        client_error=importlib.import_module("vllm.exceptions").VLLMClientError,
        engine_dead=importlib.import_module("vllm.v1.engine.exceptions").EngineDeadError,
    )
