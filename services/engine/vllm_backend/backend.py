"""VllmBackend: vLLM's AsyncLLM in-process, behind the EngineBackend contract.

The engine core runs in its own process (vLLM starts it); this object lives on
the engine service's event loop and owns, on that loop only:
- `_active`: the requests it has handed to vLLM and not yet seen finish
  (request ids for LoadReport, and the "nothing running" truth for load());
- the KV translator (fed by the ZMQ subscriber task) and the stats record
  (fed by vLLM's stat-logger hook, also called on this loop).

Mapping to vLLM: token-id prompts (TokensPrompt), DELTA outputs, priority
scheduling (lower value first, as kvmesh's P0..P2; max_num_seqs includes the
P0 headroom, see launch.py), `abort(id)` on cancel.
The adapter's other modules each do one job for it: vllm_api.py (the vLLM
names, imported once), launch.py (engine arguments, resolved config,
warm-up, pinning), convert.py (sampling in, outputs out), kv_events.py and
kv_translate.py (the prefix-cache events), stats.py (scheduler statistics),
env.py (process environment).

Checks: the runtime applies the rules every backend shares before
`generate`; this adapter adds only vLLM's own -- its SamplingParams
validation and the input checks of its processor (a VLLMClientError before
the first output), both InvalidRequest.

Failures: the engine watches vLLM's processes itself (process_watch.py):
the death of its engine core or worker is `dead_reason()` within a fraction
of a second, and the rest of the tree it started is killed then (and at
stop, after vLLM's own shutdown) -- vLLM's client took up to a minute to
notice, while an orphaned worker kept its core and its GPU memory.
vLLM's EngineDeadError (its engine core process died, or the
worker process under it that runs the model -- the core's executor watches
it and fails the core: vLLM raises it for every live request, and `errored`
turns true even while idle) is EngineDead, the engine's failure; any other error ends only its
request, with finish_reason "error".
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncGenerator, Callable
from typing import Any

from services.common.config import EngineConfig, MeshConfig
from services.common.finish_reason import FinishReason
from services.engine.backend import (
    BackendActivity,
    BackendInfo,
    EngineDead,
    GenerationOutput,
    GenerationRequest,
    InvalidRequest,
    KvListener,
    LoadSnapshot,
    StepObserver,
)
from services.engine.vllm_backend.convert import RequestUsage, held_text, sampling_params
from services.engine.vllm_backend.env import prepare_environment, resolve_path
from services.engine.vllm_backend.kv_events import KvEventSubscriber
from services.engine.vllm_backend.kv_translate import KvDelta, KvTranslator
from services.engine.vllm_backend.launch import (
    engine_args,
    pin_processes,
    replay_endpoint,
    resolved_info,
    set_vllm_tracing,
    warm_up,
)
from services.engine.vllm_backend.process_watch import ProcessWatch, vllm_descendants
from services.engine.vllm_backend.stats import EngineStats, make_stat_logger_factory
from services.engine.vllm_backend.vllm_api import VllmApi, import_vllm

__all__ = ["BackendNotStarted", "VllmBackend"]

# Seconds vLLM's engine core gets to exit before vLLM kills it.
SHUTDOWN_TIMEOUT_SECONDS = 2.0
log = logging.getLogger("kvmesh.engine.vllm")


class BackendNotStarted(RuntimeError):
    """generate()/abort() before start() returned, or after stop()."""


class VllmBackend:
    """The real engine. `VllmBackend(config, engine)`, then `await start()`."""

    def __init__(self, config: MeshConfig, engine: EngineConfig) -> None:
        self._mesh = config
        self._engine = engine
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
            p0_headroom=engine.p0_headroom,
        )
        self._llm: Any = None
        self._api: VllmApi | None = None
        # Request ids handed to vLLM, oldest first (a dict for its order).
        self._active: dict[str, None] = {}
        self._stats = EngineStats()
        self._translator: KvTranslator | None = None
        self._subscriber: KvEventSubscriber | None = None
        self._listener: KvListener | None = None
        self._on_change: Callable[[], None] | None = None
        self._last_reported = (0, 0)
        self._stopped = False
        self._watch: ProcessWatch | None = None
        self._foreign: frozenset[tuple[int, int]] = frozenset()
        self.startup_seconds = 0.0
        # vLLM exports its own spans there when tracing is on (launch.py).
        self._traces_url = config.tracing.traces_url if config.tracing.enabled else None

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
        # vLLM processes already under this process are not this backend's
        # (another in-process backend's): never watched, pinned or killed.
        self._foreign = frozenset((p.pid, p.start_ticks) for p in vllm_descendants(os.getpid()))
        replay = await self._launch()
        try:
            # From here a dead core or worker is seen at once, warm-up included.
            watch = self._watch = ProcessWatch(os.getpid(), foreign=self._foreign)
            watch.start()
            self.info = resolved_info(self._llm, self._model_name, self._mesh.hash_block_tokens,
                                      self._engine.p0_headroom)
            self._translator = KvTranslator(self.info.block_size, self._mesh.hash_block_tokens)
            if self._subscriber is not None:
                self._subscriber.start(self._translator, replay)
            await warm_up(self.generate)
        except BaseException:
            await self._teardown()
            raise
        if self._vcfg.pin_vllm_processes:
            pin_processes(self._vcfg.omp_threads_bind, [p.pid for p in watch.processes])
        self.startup_seconds = time.monotonic() - began
        log.info(
            "vLLM ready in %.1f s: %s, block %d x %d, max_model_len %d",
            self.startup_seconds,
            self._model_name,
            self.info.block_size,
            self.info.total_blocks,
            self.info.max_model_len,
        )

    async def _launch(self) -> str | None:
        """Import vLLM and start its engine; returns the KV replay endpoint."""
        restore_env = prepare_environment(self._scratch, self._vcfg.omp_threads_bind)
        try:
            # Importing vLLM takes 13-16 s: keep the loop (health checks) alive.
            api = self._api = await asyncio.to_thread(import_vllm)
            if self._vcfg.enable_prefix_caching:
                self._subscriber = KvEventSubscriber(
                    self._on_kv_delta, api.kv_event_batch, port=self._vcfg.kv_events_port
                )
            # else no prefix cache, no events: the scheduler gets no affinity
            replay = replay_endpoint(self._scratch)
            kv_endpoint = self._subscriber.endpoint if self._subscriber is not None else None
            args = engine_args(api, self._engine, self._model_path, self._model_name,
                               self.info.max_model_len, kv_endpoint, replay)
            if self._traces_url:
                set_vllm_tracing(args, self._traces_url, self._mesh.tracing.service("vllm"))
            factory = make_stat_logger_factory(self._stats, self._stats_recorded)
            # Construction waits for the engine core's handshake; vLLM needs it
            # on the loop that will run its output handler.
            self._llm = api.async_llm.from_engine_args(args, stat_loggers=[factory])
        except BaseException:
            await self._teardown()
            raise
        finally:
            restore_env()
        return replay

    async def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        if self._watch is not None:  # vLLM's processes now end on our word: no deaths
            self._watch.pause()
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
        # Whatever vLLM's shutdown left (an orphaned worker of a dead core,
        # a core a failed start left behind) ends too: no process of this
        # engine outlives it.
        watch, self._watch = self._watch or ProcessWatch(os.getpid(), foreign=self._foreign), None
        await watch.stop()
        if self._subscriber is not None:
            await self._subscriber.stop()
            self._subscriber = None

    # ------------------------------------------------------------ requests

    def _started_api(self) -> VllmApi:
        if self._llm is None or self._stopped or self._api is None:
            raise BackendNotStarted("the vLLM backend is not running")
        return self._api

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[GenerationOutput, None]:
        api = self._started_api()
        params = sampling_params(api, request.sampling, request.resumed_tokens)
        rid = request.request_id
        self._active[rid] = None
        self._notify()
        # Traced: the engine span's context, which vLLM's `llm_request` span continues.
        traced = {"trace_headers": request.trace_headers} if self._traces_url and request.trace_headers else {}
        stream = self._llm.generate(
            api.tokens_prompt(prompt_token_ids=list(request.prompt_token_ids)),
            params,
            rid,
            priority=request.priority,
            **traced,
        )
        usage = RequestUsage(
            prompt_tokens=len(request.prompt_token_ids) - request.resumed_tokens,
            completion_tokens=request.resumed_tokens,
        )
        finished = False
        try:
            while not finished:
                output = await self._next_output(api, stream, usage, rid)
                finished = output.finish_reason is not None
                if request.sampling.stop and not finished:
                    output.held_text = held_text(self._llm, rid)
                yield output
        finally:
            self._active.pop(rid, None)
            if not finished:
                # Closed early (aclose, cancellation) or refused: vLLM's
                # generator aborts the request in the engine core when closed.
                await stream.aclose()
            self._notify()

    async def _next_output(self, api: VllmApi, stream: Any, usage: RequestUsage,
                           rid: str) -> GenerationOutput:
        """The stream's next output, converted; a failure becomes this
        request's final "error" output (the engine lives on), or
        InvalidRequest if vLLM refused the request before any output."""
        try:
            out = await stream.__anext__()
        except StopAsyncIteration:
            # vLLM ends an aborted stream without a final output of its own.
            return usage.finish(FinishReason.ABORT, "aborted")
        except api.engine_dead as exc:  # the core died: every live request gets this
            raise EngineDead(f"vLLM's engine core or its worker died ({type(exc).__name__}: {exc})") from exc
        except api.client_error as exc:
            if usage.outputs == 0:
                raise InvalidRequest(str(exc)) from exc
            return usage.finish(FinishReason.ERROR, str(exc))
        except Exception as exc:  # an internal error of this request: it fails, the engine lives on
            log.exception("vLLM generation %s failed", rid)
            return usage.finish(FinishReason.ERROR, f"engine error: {type(exc).__name__}: {exc}")
        return usage.convert(out)

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
            prefill_tokens_per_second=self._stats.speed.prefill_tokens_per_second,
            step_seconds=self._stats.speed.step_seconds_at(running),
        )

    def kv_snapshot(self) -> list[int]:
        return self._translator.snapshot() if self._translator else []

    def set_kv_listener(self, listener: KvListener | None) -> None:
        self._listener = listener

    def on_change(self, callback: Callable[[], None] | None) -> None:
        self._on_change = callback

    def set_step_observer(self, observer: StepObserver | None) -> None:
        self._stats.observer = observer  # the stat logger forwards each step (stats.py)

    def dead_reason(self) -> str | None:
        if self._llm is None or self._stopped:
            return None
        death = self._watch.death if self._watch is not None else None
        if death is not None:
            return death.describe(time.monotonic())
        if not self._llm.errored:
            return None
        return "vLLM's engine core or its worker died (AsyncLLM.errored)"

    def activity(self) -> BackendActivity | None:
        if self._watch is None or self._stopped:
            return None
        return self._watch.activity()

    async def probe(self) -> None:
        if self._llm is not None and not self._stopped:
            # A round trip through the engine core's input queue: a wedged or
            # stopped core never answers (AsyncLLM.check_health only reads a flag).
            await self._llm.is_sleeping()

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
