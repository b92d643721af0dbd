"""Starting vLLM for `VllmBackend.start()`: the engine arguments from
kvmesh's config, what vLLM resolved (read back into BackendInfo), the warm-up
generations, and pinning vLLM's processes to the OpenMP cores.

Stateless functions; the backend owns the engine they start.
"""

from __future__ import annotations

import asyncio
import logging
import os
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from services.common.affinity import omp_cores, pin_threads
from services.common.config import EngineConfig
from services.common.openai_api.structured_outputs import StructuredSpec
from services.engine.backend import BackendInfo, GenerationOutput, GenerationRequest, Sampling
from services.engine.vllm_backend.vllm_api import VllmApi

__all__ = ["engine_args", "pin_processes", "replay_endpoint", "resolved_info", "set_vllm_tracing", "warm_up"]

log = logging.getLogger("kvmesh.engine.vllm")

_GIB = 1 << 30
_WARM_SCHEMA = StructuredSpec("json_schema", '{"type": "object", "properties": {"a": {"type": "integer"}}}')
# vLLM loads it by name in its engine core (and its request validator).
RESUME_GRAMMAR_PROCESSOR = "services.engine.vllm_backend.resume_grammar:ResumedGrammarProcessor"
# Unix socket paths are limited to 107 bytes; longer scratch paths skip replay.
_MAX_IPC_PATH = 100


def replay_endpoint(scratch: Path) -> str | None:
    """An ipc endpoint in `scratch` for vLLM's KV-event replay socket, or None
    (no replay) when the path is too long for a Unix socket."""
    path = scratch / "kv-replay.ipc"
    if len(str(path)) > _MAX_IPC_PATH:
        log.warning("scratch path too long for an ipc socket; KV replay disabled")
        return None
    path.unlink(missing_ok=True)
    return f"ipc://{path}"


def engine_args(api: VllmApi, engine: EngineConfig, model_path: Path, model_name: str, max_model_len: int,
                kv_endpoint: str | None, replay: str | None) -> Any:
    """vLLM's AsyncEngineArgs. `kv_endpoint` None = no KV events (no prefix
    cache). vLLM's batch (max_num_seqs) is vllm.max_num_seqs + p0_headroom:
    the runtime keeps the classes > P0 to vllm.max_num_seqs, so a P0 always
    finds a running slot and vLLM's priority policy preempts the lowest
    class first when blocks run short."""
    v = engine.vllm
    kv_events = None
    if kv_endpoint is not None:
        kv_events = api.kv_events_config(
            enable_kv_cache_events=True,
            publisher="zmq",
            endpoint=kv_endpoint,  # no wildcard: vLLM connects to us
            replay_endpoint=replay,
            topic="",
        )
    return api.engine_args(
        model=str(model_path),
        tokenizer=str(model_path),
        served_model_name=[model_name],
        dtype=v.dtype,
        enforce_eager=v.enforce_eager,
        kv_cache_memory_bytes=int(v.kv_cache_gib * _GIB),
        max_num_seqs=v.max_num_seqs + engine.p0_headroom,
        max_num_batched_tokens=v.max_num_batched_tokens or None,
        max_model_len=max_model_len or None,
        block_size=v.block_size or None,
        enable_prefix_caching=v.enable_prefix_caching,
        seed=v.seed,
        scheduling_policy="priority",
        kv_events_config=kv_events,
        # Our stat logger replaces vLLM's periodic log line and Prometheus.
        disable_log_stats=True,
        # Structured outputs: one grammar engine for fresh requests (vLLM's
        # own path) and resumed ones (kvmesh's logits processor continues the
        # grammar after a migration), so a prefix one accepted the other
        # accepts too. xgrammar without the "auto" fallback to guidance: a
        # constraint xgrammar cannot compile is refused (400) up front.
        structured_outputs_config=api.structured_outputs_config(backend="xgrammar"),
        logits_processors=[RESUME_GRAMMAR_PROCESSOR],
    )


def set_vllm_tracing(args: Any, traces_url: str, service_name: str) -> None:
    """Tracing on: vLLM exports an `llm_request` span per request (queue,
    prefill, decode times) below the engine's span (the request's
    trace_headers) to `traces_url`. vLLM reads its exporter's protocol and its service name from the
    environment (vllm/tracing/otel.py): OTLP over http/protobuf like the
    rest of the mesh (its default is gRPC), as `<service_name>-vllm`. Set
    before AsyncLLM starts, in the engine process only."""
    args.otlp_traces_endpoint = traces_url
    os.environ["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] = "http/protobuf"
    os.environ["OTEL_SERVICE_NAME"] = service_name


def resolved_info(llm: Any, model_name: str, hash_block_tokens: int, p0_headroom: int = 0) -> BackendInfo:
    """What the started engine really has (vLLM resolves block size, blocks,
    model length and vocabulary itself); max_running is its max_num_seqs
    less the P0 headroom `engine_args` added."""
    vllm_config = llm.vllm_config
    cache = vllm_config.cache_config
    model = vllm_config.model_config
    block_size = int(cache.block_size)
    if block_size % hash_block_tokens:
        raise ValueError(
            f"vLLM block size {block_size} is not a multiple of hash_block_tokens "
            f"{hash_block_tokens}: set engines.template.vllm.block_size to a multiple of it"
        )
    return BackendInfo(
        model=model_name,
        block_size=block_size,
        total_blocks=int(cache.num_gpu_blocks or 0),
        max_running=int(vllm_config.scheduler_config.max_num_seqs) - p0_headroom,
        max_model_len=int(model.max_model_len),
        vocab_size=int(model.get_vocab_size()),
        p0_headroom=p0_headroom,
    )


async def warm_up(generate: Callable[[GenerationRequest], AsyncIterator[GenerationOutput]]) -> None:
    """Short real generations before reporting ready: the first step, the
    first logprobs request and the first penalised/top-k sample each pay
    one-off costs (allocation, kernel selection, TorchScript; ~2 s for
    logprobs here) that a client should not see. So does the first
    structured output: vLLM builds xgrammar's view of the whole vocabulary
    then (tens of seconds on a loaded 2-core machine, long enough for the
    liveness bound to call a serving engine hung)."""
    prompt = list(range(1, 17))
    variants = [
        Sampling(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=1),
        Sampling(
            max_tokens=4, temperature=0.8, top_p=0.9, top_k=20, min_p=0.05, seed=1,
            presence_penalty=0.1, frequency_penalty=0.1, repetition_penalty=1.1,
            ignore_eos=True,
        ),
        Sampling(max_tokens=4, temperature=0.0, structured=_WARM_SCHEMA),
    ]

    async def one(sampling: Sampling) -> None:
        request = GenerationRequest(
            request_id=f"kvmesh-warmup-{uuid.uuid4().hex[:8]}",
            prompt_token_ids=prompt,
            sampling=sampling,
            priority=0,
        )
        async for out in generate(request):
            if out.finish_reason is not None and not out.finish_reason.ok:
                raise RuntimeError(f"vLLM warm-up failed: {out.finish_reason} {out.message}")

    await asyncio.gather(*(one(s) for s in variants))


def pin_processes(omp_threads_bind: str, pids: list[int]) -> None:
    """Pin this engine's vLLM engine core and worker (`pids`, its process
    watch's) to the OpenMP cores, when the binding is a core list."""
    try:
        cpus = omp_cores(omp_threads_bind)
    except ValueError:
        log.info("vLLM's processes not pinned: OpenMP binding %r is not a core list", omp_threads_bind)
        return
    threads = pin_threads(pids, cpus)
    log.info("vLLM's engine core and worker (%d processes, %d threads) pinned to cores %s",
             len(pids), threads, ",".join(map(str, sorted(cpus))))
