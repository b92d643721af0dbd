"""VllmBackend: vLLM's AsyncLLM in-process, behind the EngineBackend contract.

The engine core runs in its own process (vLLM starts it); this object lives on
the engine service's event loop and owns, on that loop only:
- `_active`: the requests it has handed to vLLM and not yet seen finish
  (request ids for LoadReport, and the "nothing running" truth for load());
- the KV translator (fed by the ZMQ subscriber task) and the stats record
  (fed by vLLM's stat-logger hook, also called on this loop).

Mapping to vLLM: token-id prompts (TokensPrompt), DELTA outputs, priority
scheduling (lower value first, as kvmesh's P0..P2), `abort(id)` on cancel.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from services.common.affinity import omp_cores, pin_vllm_processes
from services.common.config import EngineConfig, MeshConfig
from services.engine.backend import (
    BackendInfo,
    GenerationOutput,
    GenerationRequest,
    InvalidRequest,
    KvListener,
    LoadSnapshot,
    Sampling,
)
from services.engine.vllm_backend.env import prepare_environment, resolve_path
from services.engine.vllm_backend.kv_events import KvEventSubscriber
from services.engine.vllm_backend.kv_translate import KvDelta, KvTranslator
from services.engine.vllm_backend.stats import EngineStats, make_stat_logger_factory

__all__ = ["BackendNotStarted", "VllmBackend", "sampling_kwargs"]

# Seconds vLLM's engine core gets to exit before vLLM kills it.
SHUTDOWN_TIMEOUT_SECONDS = 2.0
log = logging.getLogger("kvmesh.engine.vllm")

_GIB = 1 << 30
_FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "abort"}
# Unix socket paths are limited to 107 bytes; longer scratch paths skip replay.
_MAX_IPC_PATH = 100


class BackendNotStarted(RuntimeError):
    """generate()/abort() before start() returned, or after stop()."""


@dataclass
class _Active:
    prompt_tokens: int
    priority: int
    started: float
    first_output: bool = False


def sampling_kwargs(sampling: Sampling) -> dict[str, Any]:
    """kvmesh Sampling -> vLLM SamplingParams keyword arguments. None means
    "engine default", so it is left out and vLLM's default applies."""
    kwargs: dict[str, Any] = {
        "max_tokens": sampling.max_tokens,
        "min_tokens": sampling.min_tokens,
        "ignore_eos": sampling.ignore_eos,
    }
    optional = {
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k,
        "min_p": sampling.min_p,
        "seed": sampling.seed,
        "presence_penalty": sampling.presence_penalty,
        "frequency_penalty": sampling.frequency_penalty,
        "repetition_penalty": sampling.repetition_penalty,
        "logprobs": sampling.logprobs,
    }
    kwargs.update({k: v for k, v in optional.items() if v is not None})
    if sampling.stop:
        kwargs["stop"] = list(sampling.stop)
    if sampling.stop_token_ids:
        kwargs["stop_token_ids"] = list(sampling.stop_token_ids)
    return kwargs


class VllmBackend:
    """The real engine. `VllmBackend(config, engine)`, then `await start()`."""

    def __init__(self, config: MeshConfig, engine: EngineConfig) -> None:
        self._mesh = config
        self._engine_cfg = engine
        self._vcfg = engine.vllm
        model = config.model(engine.model)
        self._model_name = model.name
        self._model_path = resolve_path(model.path)
        self._scratch = resolve_path(config.run_dir) / "vllm" / engine.engine_id
        # Provisional until start() reads vLLM's resolved configuration.
        self.info = BackendInfo(
            model=model.name,
            block_size=self._vcfg.block_size,
            total_blocks=0,
            max_running=self._vcfg.max_num_seqs,
            max_model_len=model.max_model_len,
            vocab_size=0,
        )
        self._llm: Any = None
        self._vllm: dict[str, Any] = {}
        self._active: dict[str, _Active] = {}
        self._stats = EngineStats()
        self._translator: KvTranslator | None = None
        self._subscriber: KvEventSubscriber | None = None
        self._listener: KvListener | None = None
        self._on_change: Callable[[], None] | None = None
        self._last_reported = (0, 0)
        self._stopped = False
        self.startup_seconds = 0.0

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        if self._llm is not None:
            return
        if not (self._model_path / "config.json").is_file():
            raise FileNotFoundError(
                f"model {self._model_name!r}: no config.json in {self._model_path}; "
                "run `make setup` (python -m services.models.build)"
            )
        began = time.monotonic()
        restore_env = prepare_environment(self._scratch, self._vcfg.omp_threads_bind)
        try:
            # Importing vLLM takes 13-16 s: keep the loop (health checks) alive.
            await asyncio.to_thread(self._import_vllm)
            self._subscriber = self._make_subscriber()
            replay = self._replay_endpoint()
            args = self._engine_args(replay)
            factory = make_stat_logger_factory(self._stats, self._stats_recorded)
            # Construction waits for the engine core's handshake; vLLM needs it
            # on the loop that will run its output handler.
            self._llm = self._vllm["AsyncLLM"].from_engine_args(args, stat_loggers=[factory])
        except BaseException:
            await self._teardown()
            raise
        finally:
            restore_env()
        try:
            self._read_resolved_config()
            if self._subscriber is not None and self._translator is not None:
                self._subscriber.start(self._translator, replay)
            await self._warm_up()
        except BaseException:
            await self._teardown()
            raise
        if self._vcfg.pin_vllm_processes:
            self._pin_vllm_processes()
        self.startup_seconds = time.monotonic() - began
        log.info(
            "vLLM ready in %.1f s: %s, block %d x %d, max_model_len %d",
            self.startup_seconds,
            self._model_name,
            self.info.block_size,
            self.info.total_blocks,
            self.info.max_model_len,
        )

    def _pin_vllm_processes(self) -> None:
        try:
            cpus = omp_cores(self._vcfg.omp_threads_bind)
        except ValueError:
            log.info("vLLM's processes not pinned: OpenMP binding %r is not a core list",
                     self._vcfg.omp_threads_bind)
            return
        pinned = pin_vllm_processes(os.getpid(), cpus)
        log.info("vLLM's engine core and worker (%d processes, %d threads) pinned to cores %s",
                 len(pinned.pids), pinned.threads, ",".join(map(str, sorted(cpus))))

    async def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        if self._llm is not None and self._active:
            try:
                await self._llm.abort(list(self._active))
            except Exception:  # the engine may already be dead; we are stopping anyway
                log.exception("vLLM abort on stop failed")
        await self._teardown()

    async def _teardown(self) -> None:
        # vLLM first: its KV-event publisher flushes to our subscriber while
        # the engine core exits; closing the subscriber first left the core
        # lingering until vLLM force-killed it. shutdown() blocks, so it runs
        # in a thread and the event loop keeps serving health checks.
        if self._llm is not None:
            llm, self._llm = self._llm, None
            await asyncio.to_thread(llm.shutdown, SHUTDOWN_TIMEOUT_SECONDS)
        if self._subscriber is not None:
            await self._subscriber.stop()
            self._subscriber = None

    def _import_vllm(self) -> None:
        async_llm = importlib.import_module("vllm.v1.engine.async_llm")
        self._vllm = {
            "AsyncLLM": async_llm.AsyncLLM,
            "AsyncEngineArgs": importlib.import_module("vllm.engine.arg_utils").AsyncEngineArgs,
            "KVEventsConfig": importlib.import_module("vllm.config").KVEventsConfig,
            "TokensPrompt": importlib.import_module("vllm.inputs").TokensPrompt,
            "SamplingParams": importlib.import_module("vllm.sampling_params").SamplingParams,
            "DELTA": importlib.import_module("vllm.sampling_params").RequestOutputKind.DELTA,
            "KVEventBatch": importlib.import_module("vllm.distributed.kv_events").KVEventBatch,
            "ClientError": importlib.import_module("vllm.exceptions").VLLMClientError,
        }

    def _make_subscriber(self) -> KvEventSubscriber | None:
        if not self._vcfg.enable_prefix_caching:
            return None  # no prefix cache, no events: the scheduler gets no affinity
        return KvEventSubscriber(
            self._on_kv_delta, self._vllm["KVEventBatch"], port=self._vcfg.kv_events_port
        )

    def _replay_endpoint(self) -> str | None:
        path = self._scratch / "kv-replay.ipc"
        if len(str(path)) > _MAX_IPC_PATH:
            log.warning("scratch path too long for an ipc socket; KV replay disabled")
            return None
        path.unlink(missing_ok=True)
        return f"ipc://{path}"

    def _engine_args(self, replay: str | None) -> Any:
        v = self._vcfg
        model_len = self.info.max_model_len
        kv_events = None
        if self._subscriber is not None:
            kv_events = self._vllm["KVEventsConfig"](
                enable_kv_cache_events=True,
                publisher="zmq",
                endpoint=self._subscriber.endpoint,  # no wildcard: vLLM connects to us
                replay_endpoint=replay,
                topic="",
            )
        return self._vllm["AsyncEngineArgs"](
            model=str(self._model_path),
            tokenizer=str(self._model_path),
            served_model_name=[self._model_name],
            dtype=v.dtype,
            enforce_eager=v.enforce_eager,
            kv_cache_memory_bytes=int(v.kv_cache_gib * _GIB),
            max_num_seqs=v.max_num_seqs,
            max_num_batched_tokens=v.max_num_batched_tokens or None,
            max_model_len=model_len or None,
            block_size=v.block_size or None,
            enable_prefix_caching=v.enable_prefix_caching,
            seed=v.seed,
            scheduling_policy="priority",
            kv_events_config=kv_events,
            # Our stat logger replaces vLLM's periodic log line and Prometheus.
            disable_log_stats=True,
        )

    def _read_resolved_config(self) -> None:
        vllm_config = self._llm.vllm_config
        cache = vllm_config.cache_config
        model = vllm_config.model_config
        block_size = int(cache.block_size)
        hash_tokens = self._mesh.hash_block_tokens
        if block_size % hash_tokens:
            raise ValueError(
                f"vLLM block size {block_size} is not a multiple of hash_block_tokens "
                f"{hash_tokens}: set engines.template.vllm.block_size to a multiple of it"
            )
        self.info = BackendInfo(
            model=self._model_name,
            block_size=block_size,
            total_blocks=int(cache.num_gpu_blocks or 0),
            max_running=int(vllm_config.scheduler_config.max_num_seqs),
            max_model_len=int(model.max_model_len),
            vocab_size=int(model.get_vocab_size()),
        )
        self._translator = KvTranslator(block_size, hash_tokens)

    async def _warm_up(self) -> None:
        """Short real generations before reporting ready: the first step, the
        first logprobs request and the first penalised/top-k sample each pay
        one-off costs (allocation, kernel selection, TorchScript; ~2 s for
        logprobs here) that a client should not see."""
        prompt = list(range(1, 17))
        variants = [
            Sampling(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=1),
            Sampling(
                max_tokens=4, temperature=0.8, top_p=0.9, top_k=20, min_p=0.05, seed=1,
                presence_penalty=0.1, frequency_penalty=0.1, repetition_penalty=1.1,
                ignore_eos=True,
            ),
        ]

        async def one(sampling: Sampling) -> None:
            request = GenerationRequest(
                request_id=f"kvmesh-warmup-{uuid.uuid4().hex[:8]}",
                prompt_token_ids=prompt,
                sampling=sampling,
                priority=0,
            )
            async for out in self.generate(request):
                if out.finish_reason not in (None, "length", "stop"):
                    raise RuntimeError(f"vLLM warm-up failed: {out.finish_reason} {out.message}")

        await asyncio.gather(*(one(s) for s in variants))

    # ------------------------------------------------------------ requests

    def _validate(self, request: GenerationRequest) -> Any:
        if self._llm is None or self._stopped:
            raise BackendNotStarted("the vLLM backend is not running")
        prompt = request.prompt_token_ids
        if not prompt:
            raise InvalidRequest("prompt is empty: send at least one token id")
        if request.sampling.max_tokens < 1:
            raise InvalidRequest("max_tokens must be at least 1")
        if len(prompt) + request.sampling.max_tokens > self.info.max_model_len:
            raise InvalidRequest(
                f"prompt ({len(prompt)} tokens) + max_tokens ({request.sampling.max_tokens}) "
                f"exceeds the model's max_model_len {self.info.max_model_len}: "
                "shorten the prompt or lower max_tokens"
            )
        vocab = self.info.vocab_size
        bad = next((t for t in prompt if t < 0 or t >= vocab), None)
        if bad is not None:
            raise InvalidRequest(f"token id {bad} is outside the vocabulary [0, {vocab})")
        if not 0 <= request.priority <= 2:
            raise InvalidRequest(f"priority {request.priority} is not 0, 1 or 2")
        if request.request_id in self._active:
            raise InvalidRequest(f"request id {request.request_id!r} is already running")
        try:
            params = self._vllm["SamplingParams"](
                **sampling_kwargs(request.sampling), output_kind=self._vllm["DELTA"]
            )
        except (ValueError, TypeError, self._vllm["ClientError"]) as exc:
            raise InvalidRequest(f"invalid sampling parameters: {exc}") from exc
        return params

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationOutput]:
        params = self._validate(request)
        rid = request.request_id
        prompt_len = len(request.prompt_token_ids)
        self._active[rid] = _Active(prompt_len, request.priority, time.monotonic())
        self._notify()
        stream = self._llm.generate(
            self._vllm["TokensPrompt"](prompt_token_ids=list(request.prompt_token_ids)),
            params,
            rid,
            priority=request.priority,
        )
        usage = _Usage(
            prompt_tokens=prompt_len - request.resumed_tokens,
            completion_tokens=request.resumed_tokens,
        )
        finished = False
        try:
            while True:
                try:
                    out = await stream.__anext__()
                except StopAsyncIteration:
                    break
                except self._vllm["ClientError"] as exc:
                    if usage.outputs == 0:
                        raise InvalidRequest(str(exc)) from exc
                    finished = True
                    yield usage.finish("error", str(exc))
                    return
                except Exception as exc:  # engine dead or internal error: this request fails
                    log.exception("vLLM generation %s failed", rid)
                    finished = True
                    yield usage.finish("error", f"engine error: {type(exc).__name__}: {exc}")
                    return
                output = usage.convert(out)
                if request.sampling.stop and output.finish_reason is None:
                    output.held_text = self._held_text(rid)
                if usage.outputs == 1:
                    self._active[rid].first_output = True
                if output.finish_reason is not None:
                    finished = True
                yield output
                if finished:
                    return
            # vLLM ends an aborted stream without a final output of its own.
            finished = True
            yield usage.finish("abort", "aborted")
        finally:
            self._active.pop(rid, None)
            if not finished:
                # Closed early (aclose, cancellation): vLLM's generator aborts
                # the request in the engine core when closed.
                await stream.aclose()
            self._notify()

    def _held_text(self, request_id: str) -> str:
        """The text vLLM holds back for a possible stop string, right after
        the output just read (read in the same step of the event loop as
        that output, so it covers exactly the tokens delivered so far).
        vLLM has no API for it: this reads its output processor's
        detokenizer (vLLM 0.32); if that changes, "" (nothing recoverable at
        a migration, as before)."""
        try:
            processor = self._llm.output_processor
            for internal_id in processor.external_req_ids.get(request_id, ()):
                detokenizer = processor.request_states[internal_id].detokenizer
                return str(detokenizer.output_text[detokenizer._last_output_text_offset:])  # noqa: SLF001
        except (AttributeError, KeyError, TypeError):
            return ""
        return ""

    async def abort(self, request_id: str) -> bool:
        if request_id not in self._active or self._llm is None:
            return False
        await self._llm.abort(request_id)
        return True

    # ------------------------------------------------------------ reporting

    def load(self) -> LoadSnapshot:
        active = len(self._active)
        running = min(self._stats.running, active)
        blocks_total = self.info.total_blocks
        # Stats arrive after engine steps; with nothing active the engine is
        # idle and every block not cached is free, whatever the last step said.
        blocks_used = round(self._stats.kv_usage * blocks_total) if active else 0
        queued = self._llm.get_num_queued_tokens() if self._llm is not None and active else 0
        return LoadSnapshot(
            running=running,
            waiting=active - running,
            blocks_used=blocks_used,
            blocks_total=blocks_total,
            cached_blocks=self._translator.num_blocks if self._translator else 0,
            queued_tokens=queued,
            request_ids=list(self._active),
        )

    def kv_snapshot(self) -> list[int]:
        return self._translator.snapshot() if self._translator else []

    def set_kv_listener(self, listener: KvListener | None) -> None:
        self._listener = listener

    def on_change(self, callback: Callable[[], None] | None) -> None:
        self._on_change = callback

    @property
    def stats(self) -> EngineStats:
        """vLLM's latest scheduler view and prefix-cache counters (metrics)."""
        return self._stats

    @property
    def kv_subscriber(self) -> KvEventSubscriber | None:
        return self._subscriber

    def unfinished_in_vllm(self) -> int:
        """Requests vLLM's front end still tracks (0 once every abort landed)."""
        return self._llm.get_num_unfinished_requests() if self._llm is not None else 0

    def _on_kv_delta(self, delta: KvDelta) -> None:
        listener = self._listener
        if listener is None:
            return
        for op, hashes in delta.ops:
            if op == "cleared":
                listener.cleared()
            elif op == "stored":
                listener.stored(hashes)
            else:
                listener.removed(hashes)

    def _stats_recorded(self) -> None:
        now = (self._stats.running, self._stats.waiting)
        if now != self._last_reported:
            self._last_reported = now
            self._notify()

    def _notify(self) -> None:
        if self._on_change is not None:
            self._on_change()


@dataclass
class _Usage:
    """Per-request counters while converting vLLM's DELTA outputs."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    outputs: int = 0

    def convert(self, out: Any) -> GenerationOutput:
        self.outputs += 1
        if out.num_cached_tokens is not None:
            self.cached_tokens = int(out.num_cached_tokens)
        completion = out.outputs[0] if out.outputs else None
        token_ids = list(completion.token_ids) if completion is not None else []
        self.completion_tokens += len(token_ids)
        reason = None
        if out.finished:
            raw = completion.finish_reason if completion is not None else None
            reason = _FINISH_REASONS.get(raw or "", "error")
        return GenerationOutput(
            token_ids=token_ids,
            text=completion.text if completion is not None else "",
            logprobs=_logprobs(completion, token_ids),
            finish_reason=reason,
            prompt_tokens=self.prompt_tokens,
            cached_tokens=self.cached_tokens,
            completion_tokens=self.completion_tokens,
        )

    def finish(self, reason: str, message: str) -> GenerationOutput:
        return GenerationOutput(
            token_ids=[],
            text="",
            finish_reason=reason,
            prompt_tokens=self.prompt_tokens,
            cached_tokens=self.cached_tokens,
            completion_tokens=self.completion_tokens,
            message=message,
        )


def _logprobs(completion: Any, token_ids: list[int]) -> list[dict] | None:
    """vLLM's per-token {token_id: Logprob} -> kvmesh TokenLogprob dicts
    (token_id, token, logprob, top: [{token_id, token, logprob}], by rank)."""
    if completion is None or completion.logprobs is None:
        return None
    result: list[dict] = []
    for token_id, entries in zip(token_ids, completion.logprobs):
        chosen = entries.get(token_id)
        top = sorted(
            (
                (lp.rank if lp.rank is not None else 1 << 30, tid, lp)
                for tid, lp in entries.items()
            ),
            key=lambda item: (item[0], item[1]),
        )
        result.append(
            {
                "token_id": token_id,
                "token": (chosen.decoded_token or "") if chosen else "",
                "logprob": float(chosen.logprob) if chosen else float("-inf"),
                "top": [
                    {"token_id": tid, "token": lp.decoded_token or "", "logprob": float(lp.logprob)}
                    for _, tid, lp in top
                ],
            }
        )
    return result
