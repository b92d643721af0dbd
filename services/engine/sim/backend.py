"""`SimBackend`: the engine backend that simulates a GPU (see sim/core.py).

One task runs the step loop: schedule a step, let the cost model's time pass
(`asyncio.sleep`, 0 s when speed_factor is 0 -- a step still yields to the
event loop so gRPC and the scheduler link keep running), apply it. It sleeps on
an event while there is no work.

Faults, for tests (the simulator's stand-ins for a vLLM core SIGKILLed or
SIGSTOPped): `crash(reason)` kills the backend -- every live stream raises
EngineDead, new ones too, and `dead_reason()` says why; a step that raises
is such a crash. `hang()` wedges the step loop mid-step (no output at all
while requests are in it) until `resume()`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, Callable

from services.common.config import EngineConfig, MeshConfig
from services.engine.backend import (
    BackendActivity,
    BackendInfo,
    EngineDead,
    GenerationOutput,
    GenerationRequest,
    KvListener,
    LoadSnapshot,
    Sampling,
    StepObserver,
)
from services.engine.model import DEFAULT_MAX_MODEL_LEN, TextCodec, load_codec, resolve_model
from services.engine.sim.core import CoreLimits, SimCore, SimRequest
from services.engine.sim.cost_model import step_seconds
from services.engine.sim.speed import SimSpeed
from services.engine.sim.step_stats import SimStepMeter
from services.engine.sim.text import TokenPicker
from services.engine.step_speed import StepSpeed

__all__ = ["SimBackend"]

log = logging.getLogger(__name__)


class SimBackend:
    def __init__(self, config: MeshConfig, engine: EngineConfig, codec: TextCodec | None = None) -> None:
        spec = resolve_model(config, engine)
        self.codec = codec or load_codec(spec.path, engine.sim.vocab_size)
        # Capped at the KV capacity: the runtime's shared max_model_len rule
        # then refuses what could never fit before the core sees it.
        capacity = engine.block_size * engine.total_blocks
        max_len = min(spec.max_model_len or DEFAULT_MAX_MODEL_LEN, capacity)
        self.info = BackendInfo(
            model=spec.name,
            block_size=engine.block_size,
            total_blocks=engine.total_blocks,
            max_running=engine.max_running,
            max_model_len=max_len,
            vocab_size=self.codec.vocab_size,
            p0_headroom=engine.p0_headroom,
        )
        self._cost = engine.sim
        self._core = SimCore(
            CoreLimits(
                block_size=engine.block_size,
                total_blocks=engine.total_blocks,
                # The batch has the P0 headroom; the runtime holds the other
                # classes to max_running (services/engine/batch_gate.py).
                max_running=engine.max_running + engine.p0_headroom,
                hash_block_tokens=config.hash_block_tokens,
                chunk_tokens=engine.sim.chunk_tokens,
            ),
            TokenPicker(self.codec.clean_token_ids, self.codec.eos_token_id, engine.sim.eos_probability),
            self.codec.token_text,
            self.codec.eos_token_id,
        )
        self._wake = asyncio.Event()
        self._unwedged = asyncio.Event()  # cleared while hung (fault hook)
        self._unwedged.set()
        self._dead: str | None = None
        self._streams: dict[str, SimRequest] = {}  # live generate() streams, to fail on a crash
        self._loop_task: asyncio.Task[None] | None = None
        self._on_change: Callable[[], None] | None = None
        self._meter = SimStepMeter()  # step statistics for the engine's metrics (step_stats.py)
        # Measured step speed for the load report (step_speed.py): the sim's
        # steps as they really took, timer overshoot and slowdowns included.
        self._speed = StepSpeed(budget_tokens=engine.sim.chunk_tokens)
        # Run-time speed (speed.py): the schedule counts from the step loop's start.
        self.speed = SimSpeed(engine.sim.speed_schedule, 0.0)

    # ---------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        if self._loop_task is None:
            self.speed.begin(asyncio.get_running_loop().time())
            self._loop_task = asyncio.create_task(self._run(), name="sim-step-loop")
        if not self._cost.warm_up:
            return
        # Warm-up: one tiny real generation through the step loop. Shorter
        # than a block, so it leaves nothing in the prefix cache.
        warm = GenerationRequest("__warmup__", [self.codec.clean_token_ids[0]], Sampling(max_tokens=2))
        async for _ in self.generate(warm):
            pass

    async def stop(self) -> None:
        self._core.abort_all("engine stopping")
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task
            self._loop_task = None

    # ---------------------------------------------------------------- requests

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[GenerationOutput, None]:
        if self._dead is not None:
            raise EngineDead(self._dead)
        if self._loop_task is None:
            raise RuntimeError("SimBackend.generate before start()")
        req = self._core.add(request)  # raises InvalidRequest if it can never fit
        self._streams[request.request_id] = req
        self._meter.arrived(req, asyncio.get_running_loop().time())
        self._kick()
        try:
            while True:
                out = await req.sink.next()
                yield out
                if out.finish_reason is not None:
                    return
        finally:
            self._streams.pop(request.request_id, None)
            self._meter.forget(req)
            # Closed early (aclose / cancellation): abort at once, free blocks.
            if not req.sink.finished and self._core.abort(request.request_id, "stream closed"):
                self._kick()

    async def abort(self, request_id: str) -> bool:
        found = self._core.abort(request_id)
        if found:
            self._kick()
        return found

    def load(self) -> LoadSnapshot:
        load = self._core.load()
        load.prefill_tokens_per_second = self._speed.prefill_tokens_per_second
        load.step_seconds = self._speed.step_seconds_at(load.running)
        load.step_token_budget = self._speed.budget_tokens
        return load

    def kv_snapshot(self) -> list[int]:
        return self._core.pool.snapshot()

    def set_kv_listener(self, listener: KvListener | None) -> None:
        self._core.set_listener(listener)

    def on_change(self, callback: Callable[[], None] | None) -> None:
        self._on_change = callback

    def set_step_observer(self, observer: StepObserver | None) -> None:
        self._meter.observer = observer

    def dead_reason(self) -> str | None:
        return self._dead

    def activity(self) -> BackendActivity | None:
        return None  # the simulator runs in the engine's own loop: a silent one is wedged, never slow

    async def probe(self) -> None:
        await self._unwedged.wait()

    # ---------------------------------------------------------------- faults (tests)

    def crash(self, reason: str = "the simulator crashed") -> None:
        """Die as a whole: the step loop stops, every live stream raises EngineDead."""
        if self._dead is not None:
            return
        self._dead = reason
        if self._loop_task is not None and self._loop_task is not asyncio.current_task():
            self._loop_task.cancel()
        for req in self._streams.values():
            req.sink.fail(EngineDead(reason))

    def hang(self) -> None:
        """Wedge the step loop mid-step: no output until `resume()`."""
        self._unwedged.clear()

    def resume(self) -> None:
        self._unwedged.set()

    def reset_prefix_cache(self) -> None:
        """Drop every cached prefix (emits `cleared`)."""
        self._core.pool.clear()
        self._changed()

    # ---------------------------------------------------------------- step loop

    def _kick(self) -> None:
        self._wake.set()
        self._changed()

    def _changed(self) -> None:
        if self._on_change is not None:
            self._on_change()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self._core.has_work():
                self._wake.clear()
                await self._wake.wait()
                continue
            started = loop.time()
            try:
                plan = self._core.schedule()
            except Exception as exc:  # a sim bug: the backend is dead, like a crashed vLLM core
                log.exception("sim step failed")
                self.crash(f"the simulator's step failed: {type(exc).__name__}: {exc}")
                return
            if not plan.entries:
                # Nothing fits now (only possible transiently); wait for a change.
                self._wake.clear()
                await self._wake.wait()
                continue
            seconds = step_seconds(self._cost, plan.work) * self.speed.factor(started)
            # The step's own Python time counts as simulated time already.
            await asyncio.sleep(max(0.0, seconds - (loop.time() - started)))
            await self._unwedged.wait()
            before = self._meter.before_apply(plan)
            finished = self._core.apply(plan)
            ended = loop.time()
            self._meter.after_step(plan, before, started, ended)
            self._speed.observe(ended - started, plan.work.prefill_tokens, plan.work.decode_sequences)
            if finished or plan.changed:
                self._changed()
