"""The engine's request registry over one backend, shared by every transport.

Who checks what (each rule in one place, one answer per rule):
- `EngineRuntime.open`: the engine's state (starting, draining, stopping ->
  NotAccepting, UNAVAILABLE) and a live duplicate request id
  (DuplicateRequest, ALREADY_EXISTS);
- `validate_request`: every rule the backends share -- ids, prompt, priority,
  lengths against the backend's BackendInfo, sampling ranges (InvalidRequest,
  INVALID_ARGUMENT);
- the backend: only its own limits (services/engine/backend.py says which),
  also as InvalidRequest.
The transports (grpc_api.py, http_api.py) only map these errors.

One request failing ends only it. The backend failing as a whole -- dead
(EngineDead, `dead_reason()`) or hung (liveness.py) -- is `EngineRuntime.fail`:
every live generation is handed over (UNAVAILABLE: the gateway continues it
elsewhere), the engine stops serving, and `died` asks the process to exit.

`Generation` runs one request: a pump task drains the backend's stream into a
`DeltaBuffer` (so the backend never waits for a slow reader) and the
transport takes merged outputs from it. The pump starts when the runtime's
`BatchGate` (services/engine/batch_gate.py) lets the request into the
backend: a P0 at once, another class only while fewer than max_running
non-P0 requests are in the backend, else it waits in the gate, in (priority,
arrival) order, until one leaves. The gate's waiting requests are live like
the others: cancel and Abort end them (nothing reached the backend), a
stopping engine hands them over at once (they would only start late here),
a draining one starts them as slots free, and load reports count them as
waiting (their ids in request_ids, their prompts in queued_tokens).

Interactive requests never wait behind batch work; two levels see to it:
- the scheduler (services/scheduler) leases each engine max_running +
  engine_queue_slack slots, some kept for P0. When a P0 cannot be placed at
  once -- every slot it may use is leased -- it preempts a running lower-class
  lease, which the gateway ends losslessly and re-queues. That level acts
  across engines and between leases: it decides which engine has the work.
- the engine (this runtime, p0_headroom, and the backend's priority policy)
  acts on what has reached it. A P0 placed on an engine whose max_running
  slots hold batch work (the P0-reserved lease, a lease freed by a
  preemption whose victim is still being cancelled, a migration, the
  engine's own HTTP endpoint) joins the running batch at the next step in
  the headroom, instead of waiting seconds for a batch request to end; and
  when KV blocks run short, the backend preempts its lowest-priority running
  request (vLLM's priority policy; the sim models it) and recomputes it
  later, invisible to the scheduler. A P0 waiting in the backend only for
  blocks is admitted when a running request next needs a block and the
  lowest-priority one is preempted (vLLM v1 never preempts for a waiting
  request; see sim/core.py) -- the scheduler's block reservations at
  placement keep that rare. The engine never ends a lease itself: only the
  scheduler knows whether a victim can continue elsewhere sooner.
Both backends share this code path: the sim's batch is max_running +
p0_headroom (sim/backend.py), vLLM's max_num_seqs is vllm.max_num_seqs +
p0_headroom (vllm_backend/launch.py); each advertises max_running only.

A generation whose caller vanished is kept for a resume (detached.py).

Ownership: all state here is touched only from the event loop thread; the
registry is changed by `open` and by a generation's `close`, exactly once
each. A closed generation's id stays registered until its pump has closed the
backend's stream, so no backend ever sees an id twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, Callable
from dataclasses import replace

from services.common.clock import Clock, SystemClock
from services.common.finish_reason import FinishReason
from services.engine.backend import (
    EngineBackend,
    EngineDead,
    GenerationOutput,
    GenerationRequest,
    InvalidRequest,
    LoadSnapshot,
)
from services.engine.batch_gate import BatchGate
from services.engine.coalesce import DeltaBuffer, StreamPacing
from services.engine.detached import Keeper, OutputRecord
from services.engine.errors import DuplicateRequest, NotAccepting
from services.engine.liveness import HangPolicy, LivenessWatch
from services.engine.metrics import EngineMetrics
from services.engine.request_rules import validate_request

__all__ = ["EngineRuntime", "Generation", "validate_request"]

log = logging.getLogger(__name__)

class Generation:
    """One live request. Iterate `outputs()` once; `cancel()` aborts at once."""

    def __init__(self, runtime: EngineRuntime, request: GenerationRequest) -> None:
        self.request = request
        self._runtime = runtime
        self._buffer = DeltaBuffer()
        self._pump: asyncio.Task[None] | None = None
        self._created = runtime.clock.monotonic()
        self._first_token = False
        self._last_output: float | None = None  # the previous output's time (step intervals)
        self._completion = 0
        self._cached = 0
        self._closed = False
        self._offered = False
        # What the transport took (replayed on a resume), and the index of
        # this engine's first delta in the client's stream (delta_offset).
        self.record = OutputRecord()
        self.delta_offset = 0
        self.ack_final = False  # the caller acknowledges `finished` (engine.proto)
        # Ended by a stopping engine rather than by the client or the model:
        # the transport tells the client to continue elsewhere (UNAVAILABLE),
        # so the gateway migrates the stream from its next token.
        self.handed_over = False

    async def outputs(self, close: bool = True) -> AsyncGenerator[GenerationOutput, None]:
        """Merged outputs after those taken already; the last has
        finish_reason set. Raises InvalidRequest before any output if the
        backend refuses the request. `close=False`: the generation outlives
        the iteration (the gRPC transport may keep it for a resume)."""
        if not self._offered and not self._buffer.closed:  # cancelled before it began: never start it
            self._offered = True
            self._runtime.gate.offer(self)
        pacing, hold = self._runtime.pacing, 0.0
        try:
            while self.record.final is None:
                out = await self._buffer.take(hold)
                self.record.add(out)
                yield out
                if out.finish_reason is not None:
                    return
                hold = pacing.hold_seconds(self._runtime.gate.in_backend, self.request.priority)
        finally:
            if close:
                self.close()

    def submit(self) -> None:
        """Start the backend stream (the runtime's gate decides when)."""
        if self._pump is not None:
            return
        if self._buffer.closed:  # ended meanwhile (withdraw makes it rare): give the slot back
            asyncio.get_running_loop().call_soon(self._runtime.gate.left, self)
            return
        if self._runtime.gate.in_backend == 1:  # the backend was idle: output is owed from now
            self._runtime.liveness.entered()
        self._pump = asyncio.create_task(self._run_pump(), name=f"pump-{self.request.request_id}")
        # Whatever ends the pump (finish, cancel, error), the backend has let
        # go of the request by then: its slot goes to the next held request.
        self._pump.add_done_callback(lambda _pump: self._runtime.gate.left(self))

    def cancel(self, message: str = "cancelled by the client") -> None:
        """Abort now: stop the backend stream (which frees its blocks) and end
        the outputs with finish_reason "abort"."""
        if self._buffer.closed:
            return
        if self._pump is not None:
            if self._pump is not asyncio.current_task():  # a pump failing the engine ends itself
                self._pump.cancel()
        else:
            self._runtime.gate.withdraw(self)
        resumed = self.request.resumed_tokens
        final = GenerationOutput(
            token_ids=[], text="", finish_reason=FinishReason.ABORT, message=message,
            prompt_tokens=len(self.request.prompt_token_ids) - resumed,
            cached_tokens=self._cached, completion_tokens=resumed + self._completion,
        )
        self._runtime.metrics.finished(final, self._runtime.clock.monotonic() - self._created)
        self._buffer.push(final)

    @property
    def ended(self) -> bool:
        """Its final output is out (finished, cancelled or failed)."""
        return self._buffer.closed

    def hand_over(self, message: str) -> None:
        """End now (like `cancel`) so that another engine takes over."""
        if not self._buffer.closed:
            self.handed_over = True
            self._runtime.metrics.migrated_out()
            self.cancel(message)

    def close(self) -> None:
        """Release everything (idempotent): called when the transport is done."""
        if self._closed:
            return
        self._closed = True
        pump = self._pump
        if pump is None:
            self._runtime.gate.withdraw(self)
        if pump is None or pump.done():
            self._runtime.release(self)
            return
        pump.cancel()
        # The id stays live until the backend has let go of the request (the
        # pump closes its stream), so a request reusing it meanwhile is refused
        # here as a duplicate rather than reaching a backend that still holds it.
        pump.add_done_callback(lambda _pump: self._runtime.release(self))

    async def _run_pump(self) -> None:
        stream = self._runtime.backend.generate(self.request)
        try:
            async for out in stream:
                self._observe(out)
                self._buffer.push(out)
                if out.finish_reason is not None:
                    break
            if not self._buffer.closed:
                self._buffer.fail(RuntimeError("the backend ended the stream without a finish"))
        except asyncio.CancelledError:
            raise
        except EngineDead as exc:  # not this request's fault: the engine fails, this included
            self._runtime.fail(f"backend dead: {exc}")
        except Exception as exc:  # this request failed: surfaced to the transport, which maps it
            if not isinstance(exc, InvalidRequest):
                log.exception("generation %s failed in the backend", self.request.request_id)
            self._buffer.fail(exc)
        finally:
            with contextlib.suppress(Exception):
                await stream.aclose()

    def _observe(self, out: GenerationOutput) -> None:
        metrics = self._runtime.metrics
        now = self._last_output = self._runtime.liveness.output(self._last_output)
        if out.token_ids:
            if not self._first_token:
                self._first_token = True
                metrics.first_token(now - self._created)
            self._completion += len(out.token_ids)
            metrics.generated(len(out.token_ids))
        if out.finish_reason is not None:
            self._cached = out.cached_tokens
            metrics.finished(out, now - self._created)


class EngineRuntime:
    def __init__(
        self,
        backend: EngineBackend,
        metrics: EngineMetrics,
        clock: Clock | None = None,
        pacing: StreamPacing | None = None,
        hang: HangPolicy | None = None,
        resume_grace_seconds: float = 0.0,
    ) -> None:
        self.backend = backend
        self.metrics = metrics
        self.clock = clock or SystemClock()
        self.pacing = pacing or StreamPacing()
        self.started = False
        self.draining = False
        self.stopping = False
        # Why the engine failed as a whole (`fail`), None while it has not;
        # `died` is set with it (the process then exits for a restart).
        self.dead: str | None = None
        self.died = asyncio.Event()
        self._live: dict[str, Generation] = {}
        # The keeper is handed the lookups it needs; it does not call back into the runtime.
        self.kept: Keeper[Generation] = Keeper(self.live, self._may_keep, resume_grace_seconds)
        self.gate: BatchGate[Generation] = BatchGate(lambda: self.backend.info.max_running, metrics)
        self._listeners: list[Callable[[], None]] = []
        self._open_listeners: list[Callable[[GenerationRequest], None]] = []
        self._start_attempted = False
        self.liveness = LivenessWatch(hang or HangPolicy(), self.clock, lambda: self.gate.in_backend,
                                      backend.dead_reason, self.fail, backend.probe, backend.activity)
        metrics.watch_hang_bound(self.liveness.detector.bound)

    # ---------------------------------------------------------------- state

    @property
    def serving(self) -> bool:
        """Backend started and taking new work."""
        return self.started and not self.draining and not self.stopping and self.dead is None

    def add_listener(self, callback: Callable[[], None]) -> None:
        """Called when serving/draining or the live set changes."""
        self._listeners.append(callback)

    def add_open_listener(self, callback: Callable[[GenerationRequest], None]) -> None:
        """Called with each request accepted here (`open`), before the
        listeners of `add_listener` hear of the change."""
        self._open_listeners.append(callback)

    def _notify(self) -> None:
        for callback in self._listeners:
            callback()

    async def start(self) -> None:
        self._start_attempted = True
        await self.backend.start()
        self.started = True
        self.liveness.start()
        self._notify()

    def drain(self, hand_over: bool = False) -> None:
        """Refuse new generations (the scheduler's Drain); running ones
        finish, or with `hand_over` (an operator's `kvmesh admin
        drain-engine --move`) are handed over now: their gateways continue
        them on other engines."""
        if not self.draining:
            log.info("draining: new generations are refused, running ones %s",
                     "are handed over" if hand_over else "finish")
            self.draining = True
        if hand_over:
            for generation in [*self.gate.held, *self._live.values()]:
                generation.hand_over("engine drained by an operator; continue on another engine")
        self._notify()

    def undrain(self) -> None:
        """Take new generations again (the scheduler's Undrain)."""
        if self.draining:
            log.info("undrained: new generations are accepted again")
            self.draining = False
            self._notify()

    async def stop(self, grace_seconds: float) -> None:
        """Refuse new work, let live generations finish for up to
        `grace_seconds`, hand the rest over (their clients continue them on
        another engine), stop the backend."""
        await self.hand_off(grace_seconds)
        await self.liveness.stop()
        if self._start_attempted:  # also after a failed start: release what it got
            self._start_attempted = False
            await self.backend.stop()
        self.started = False

    async def hand_off(self, grace_seconds: float) -> int:
        """The drain, backend kept running (`stop`'s first half, also the
        engine's POST /drain): refuse new work, let live generations finish
        for up to `grace_seconds`, hand the rest over. Returns how many were
        handed over."""
        self.stopping = True
        self.kept.expire_all()
        handed: set[str] = set()
        for held in self.gate.held:  # not started here: another engine starts them sooner
            held.hand_over("engine stopping before this request started; continue on another engine")
            handed.add(held.request.request_id)
        self._notify()
        deadline = self.clock.monotonic() + grace_seconds
        # Polled, not awaited on an Event: the grace bound runs on the injected
        # clock, which a timed Event wait could not follow.
        while self._live and self.clock.monotonic() < deadline:  # noqa: ASYNC110 - see above
            await asyncio.sleep(0.05)
        for generation in list(self._live.values()):
            generation.hand_over("engine stopping after its drain timeout; continue on another engine")
            handed.add(generation.request.request_id)
        return len(handed)

    def fail(self, reason: str) -> None:
        """The engine failed as a whole, not one request (idempotent): hand
        every live generation over (the held ones first, so none starts),
        stop serving (health NOT_SERVING, load reports serving=false) and
        set `died`: the process exits non-zero and its supervisor restarts it."""
        if self.dead is not None:
            return
        self.dead = reason
        log.error("engine failed: %s; handing over %d live generations, then exiting for a restart",
                  reason, len(self._live))
        # Not serving first: the scheduler link's report (serving false, sent
        # without its usual gap) is on its way before any stream ends here,
        # so the replacements the gateways ask for are not placed here.
        self._notify()
        for generation in [*self.gate.held, *self._live.values()]:
            generation.hand_over(f"engine failed ({reason}); continue on another engine")
        self._notify()
        self.died.set()

    # ---------------------------------------------------------------- requests

    def open(self, request: GenerationRequest) -> Generation:
        if self.dead is not None:
            raise NotAccepting(f"engine failed ({self.dead}); try another engine")
        if not self.started:
            raise NotAccepting("engine is starting (model loading / warm-up); try another engine")
        if self.stopping:
            raise NotAccepting("engine is stopping; try another engine")
        if self.draining:
            raise NotAccepting("engine is draining; try another engine")
        if request.request_id in self._live:
            raise DuplicateRequest(
                f"request id {request.request_id!r} is already running here; use a new id"
            )
        validate_request(request, self.backend.info)
        generation = Generation(self, request)
        self._live[request.request_id] = generation
        for callback in self._open_listeners:
            callback(request)
        self._notify()
        return generation

    async def abort(self, request_id: str) -> bool:
        generation = self._live.get(request_id)
        if generation is not None:
            generation.cancel("aborted by an operator (Abort)")
            return True
        return await self.backend.abort(request_id)

    def generation(self, request_id: str) -> Generation | None:
        return self._live.get(request_id)

    def release(self, generation: Generation) -> None:
        """Forget a generation (its own `close` calls this once the backend let go)."""
        if self._live.get(generation.request.request_id) is generation:
            del self._live[generation.request.request_id]
            self._notify()

    def live(self, request_id: str) -> Generation | None:
        return self._live.get(request_id)

    def _may_keep(self) -> bool:
        """A generation whose caller vanished may wait for a resume: the
        engine neither failed nor is stopping (detached.py)."""
        return self.dead is None and not self.stopping

    @property
    def live_count(self) -> int:
        return len(self._live)

    # ---------------------------------------------------------------- views

    def load(self) -> LoadSnapshot:
        if not self.started or self.dead is not None:
            info = self.backend.info
            return LoadSnapshot(0, 0, 0, info.total_blocks, 0, 0, [])
        load = self.backend.load()
        held = self.gate.held_ids
        if not held:
            return load
        return replace(load, waiting=load.waiting + len(held),
                       queued_tokens=load.queued_tokens + self.gate.held_tokens,
                       request_ids=[*load.request_ids, *held])

    def kv_snapshot(self) -> list[int]:
        return self.backend.kv_snapshot() if self.started and self.dead is None else []
