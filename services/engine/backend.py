"""The contract between the engine service and what actually generates tokens.

Two backends implement it: `sim` (services/engine/sim/) and `vllm`
(services/engine/vllm_backend/). The engine service (gRPC Generate/Abort/GetInfo,
the Connect stream to the scheduler, metrics, the OpenAI HTTP endpoint) is
written once against this protocol and never knows which backend it drives.

Division of checks: the runtime (services/engine/runtime.py) applies every
rule the backends share before `generate` is called -- a request reaching a
backend has a non-empty id that no request the backend still holds uses, a
non-empty prompt inside the vocabulary, prompt + max_tokens within
`info.max_model_len`, a priority in 0..2 and sampling values in range; and
the runtime hands a backend at most `info.max_running` requests of priority
> 0 at a time, so its batch of max_running + p0_headroom always has room for
a P0 (services/engine/batch_gate.py). A
backend checks only what is its own (the sim: enough KV blocks; vLLM: its
SamplingParams and input processing) and raises InvalidRequest for it.

Failures, two kinds kept apart: one request's (InvalidRequest, or a final
output with finish_reason "error": the engine lives on) and the whole
backend's (`EngineDead`: its core process or a worker died, the simulator
crashed). A backend raises EngineDead from every live `generate` when it
can run nothing any more, and says so from `dead_reason()` even with no
request live; the runtime then fails the engine as a whole (runtime.py).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import Protocol

from services.common.finish_reason import FinishReason
from services.common.openai_api.structured_outputs import StructuredSpec

__all__ = [
    "BackendActivity",
    "BackendInfo",
    "EngineBackend",
    "EngineDead",
    "GenerationOutput",
    "GenerationRequest",
    "InvalidRequest",
    "KvListener",
    "LoadSnapshot",
    "RequestPhases",
    "Sampling",
    "StepObserver",
]


class InvalidRequest(ValueError):
    """The request can never run on this engine (maps to INVALID_ARGUMENT)."""


class EngineDead(RuntimeError):
    """The backend as a whole failed, not this request: nothing can run on it
    any more (vLLM's EngineDeadError, a dead worker, a simulator crash)."""


@dataclass(frozen=True)
class BackendInfo:
    model: str
    block_size: int          # tokens per KV block
    total_blocks: int
    max_running: int         # advertised batch (scheduler's lease math); classes > P0 never exceed it
    max_model_len: int
    vocab_size: int
    # Running slots the backend's batch has beyond max_running, which only
    # P0 requests reach (the runtime's BatchGate holds the other classes to
    # max_running): the backend's batch is max_running + p0_headroom.
    p0_headroom: int = 0


@dataclass
class Sampling:
    """Mirror of kvmesh.v1.SamplingParams; None = engine default."""

    max_tokens: int
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logprobs: int | None = None
    ignore_eos: bool = False
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> bias in [-100, 100]
    # Constrain the output; a resumed request (GenerationRequest.resumed_tokens)
    # continues the constraint after the tokens already generated.
    structured: StructuredSpec | None = None


@dataclass
class GenerationRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: Sampling
    priority: int = 1          # 0 (P0) .. 2 (P2); lower runs first
    resumed_tokens: int = 0    # tail of prompt_token_ids generated elsewhere (migration)
    # W3C trace headers of the engine's span (tracing on): the backend passes
    # them on (vLLM's AsyncLLM.generate `trace_headers`); None when off.
    trace_headers: dict[str, str] | None = None
    # The scheduler replica holding its lease (EngineRequest.scheduler_replica;
    # "" = any): whose fences may end it (services/engine/fencing.py).
    scheduler_replica: str = ""


@dataclass
class GenerationOutput:
    """One step's new tokens for one request. `finish_reason` is set on the
    last output only: stop, length, abort or error."""

    token_ids: list[int]
    text: str
    logprobs: list[dict] | None = None
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    message: str = ""
    # Text of the tokens so far held back for a possible stop string (see
    # EngineDelta.held_text); the latest output's value is the current one.
    held_text: str = ""


@dataclass
class LoadSnapshot:
    running: int
    waiting: int
    blocks_used: int
    blocks_total: int
    cached_blocks: int
    queued_tokens: int
    request_ids: list[str]
    # The engine's measured step speed (services/engine/step_speed.py); 0 = unknown.
    prefill_tokens_per_second: float = 0.0
    step_seconds: float = 0.0
    step_token_budget: int = 0


@dataclass(frozen=True)
class RequestPhases:
    """Where a finished request's time went, as vLLM's FinishedRequestStats:
    queued (arrival -> first scheduled), prefill (-> first token), decode
    (first -> last token), in seconds."""

    queued: float
    prefill: float
    decode: float


@dataclass(frozen=True)
class BackendActivity:
    """Evidence that a backend without output is slow rather than hung
    (services/engine/slow_or_hung.py): `runnable_seconds`, the seconds its
    processes' threads have spent on a CPU or waiting in a run queue for
    one, ever (only differences count); `stopped`, why one of them is
    stopped (SIGSTOP) and so cannot progress, or None."""

    runnable_seconds: float
    stopped: str | None = None


class StepObserver(Protocol):
    """Receives a backend's step statistics (services/engine/metrics.py):
    figures only the backend knows -- vLLM's from its stat logger, the sim's
    from its step loop. Called on the event loop; each call cheap."""

    def step(self, seconds: float | None, tokens: int, preempted: int) -> None: ...

    def inter_token(self, seconds: float) -> None: ...

    def request_phases(self, phases: RequestPhases) -> None: ...


class KvListener(Protocol):
    """Receives prefix-cache changes, already in the shared hash space."""

    def stored(self, hashes: list[int]) -> None: ...

    def removed(self, hashes: list[int]) -> None: ...

    def cleared(self) -> None: ...


class EngineBackend(Protocol):
    info: BackendInfo

    async def start(self) -> None:
        """Load the model and run a warm-up generation; the engine reports
        SERVING only after this returns."""

    async def stop(self) -> None:
        """Abort everything and release resources."""

    def generate(self, request: GenerationRequest) -> AsyncGenerator[GenerationOutput, None]:
        """Stream outputs for a request that passed the runtime's shared rules.
        Raise InvalidRequest (before the first output) if it can never run
        here for a reason of this backend's own. Closing the iterator early (aclose, cancellation) must
        abort the request in the engine at once and free its blocks."""

    async def abort(self, request_id: str) -> bool:
        """Abort a running or waiting request; False if unknown."""

    def load(self) -> LoadSnapshot:
        """Current load, cheap enough to call every report interval."""

    def kv_snapshot(self) -> list[int]:
        """Every hash (shared hash space) the prefix cache holds now."""

    def set_kv_listener(self, listener: KvListener | None) -> None:
        """Where to send stored/removed/cleared events from now on."""

    def on_change(self, callback: Callable[[], None] | None) -> None:
        """Called (from the event loop) when load changed notably, so a
        report can go out before the next interval."""

    def set_step_observer(self, observer: StepObserver | None) -> None:
        """Where to send per-step and per-request statistics from now on."""

    def dead_reason(self) -> str | None:
        """None while the backend can serve; once it never can again (its
        core process died...), why. Cheap: polled about once a second."""

    def activity(self) -> BackendActivity | None:
        """How much its processes ran or waited to run (`BackendActivity`),
        asked only once it has been silent past its hang bound; None when
        the backend cannot tell (then silence past the bound is a hang)."""

    async def probe(self) -> None:
        """Return once the backend has shown that its loop still runs (vLLM:
        a utility call the engine core answers between two steps; sim: the
        step loop not wedged). It does not return while the backend is hung:
        the liveness watch bounds it. Asked only while the backend holds no
        request (then no output can show its progress)."""
