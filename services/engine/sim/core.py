"""The simulated GPU's scheduler: continuous batching over paged KV blocks.

One step = schedule (pick work within the token budget and the blocks) ->
run (the cost model's time passes, in sim/backend.py) -> apply (tokens
computed, blocks cached, one token sampled per finished prefill/decode).

* Running requests go first: a decode needs one token of budget, a prefill
  continues by a chunk of at most the remaining budget (chunked prefill,
  `chunk_tokens` per step). When a running request needs a block and none is
  free, the worst running request -- highest priority value, then latest
  arrival -- is preempted: its blocks are released (full ones stay in the
  prefix cache) and it waits again, to be recomputed later from its tokens.
* Waiting requests are admitted in (priority, arrival) order while the batch
  has room (`max_running`), budget and blocks; the first that does not fit
  blocks the ones behind it (strict priority, never over-allocate). At its
  first admission a request's prompt is matched against the prefix cache; the
  hit is reported as cached_tokens and those tokens are not prefilled. No
  request is admitted in a step that had to preempt.
* A waiting request never preempts a running one, whatever its priority: a
  P0 head short only of blocks waits until a running request next needs a
  block and the lowest-priority running one is preempted (or one finishes).
  That is vLLM v1's priority policy exactly (it preempts only while
  scheduling RUNNING requests; its waiting loop stops at the first request
  without blocks), and the sim is there to predict vLLM. Batch slots are the
  engine's p0_headroom (services/engine/batch_gate.py); a P0 that cannot be
  placed is the scheduler's to preempt for (services/engine/runtime.py).
* A request that could never fit (more blocks than the engine has) is refused
  at submission, so the queue can never deadlock. That is the sim's only
  request check: the rules every backend shares (ids, prompt, lengths,
  vocabulary, sampling) are the runtime's (services/engine/runtime.py).

Ownership: a `SimCore` is owned by one `SimBackend`. Every method is
synchronous and runs on the event loop thread, and no method awaits, so a
step's schedule and apply phases each see a consistent state. An abort between
them (while the step's time passes) is fine: apply skips requests that are no
longer running.
"""

from __future__ import annotations

import enum
import heapq
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from services.common.finish_reason import FinishReason
from services.common.prefix_hash import ROOT_HASH, chain_hash
from services.common.stop_text import StopText
from services.engine.backend import (
    GenerationOutput,
    GenerationRequest,
    InvalidRequest,
    KvListener,
    LoadSnapshot,
)
from services.engine.sim.blocks import BlockPool
from services.engine.sim.cost_model import StepWork
from services.engine.sim.sink import OutputSink
from services.engine.sim.structured import StructuredScript
from services.engine.sim.text import TokenPicker, biased, roll, roll_all, sampling_salt

__all__ = ["CoreLimits", "OutputSink", "SimCore", "SimRequest", "StepPlan"]


class RequestState(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True)
class CoreLimits:
    block_size: int
    total_blocks: int
    max_running: int
    hash_block_tokens: int
    chunk_tokens: int

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size % self.hash_block_tokens:
            raise ValueError(
                f"block_size {self.block_size} must be a positive multiple of "
                f"hash_block_tokens {self.hash_block_tokens}"
            )
        if self.max_running <= 0 or self.chunk_tokens <= 0:
            raise ValueError("max_running and chunk_tokens must be positive")


@dataclass(eq=False)
class SimRequest:
    request_id: str
    tokens: list[int]               # prompt, then every generated token
    prompt_len: int
    priority: int
    arrival: int                    # tie-break: earlier first
    request: GenerationRequest
    sink: OutputSink
    stop_text: StopText
    rolling: int                    # rolling hash over `tokens`
    # Mixed into each pick when the request samples (temperature > 0): from
    # its seed, else random. 0 = greedy.
    salt: int = 0
    script: StructuredScript | None = None  # a structured output's instance (sim/structured.py)
    state: RequestState = RequestState.WAITING
    num_computed: int = 0           # tokens whose KV exists
    num_cached: int | None = None   # prefix-cache hit at first admission
    generated: int = 0
    blocks: list[int] = field(default_factory=list)
    shared_hashes: list[int] = field(default_factory=list)  # per full hash-block, computed lazily

    def sort_key(self) -> tuple[int, int]:
        return (self.priority, self.arrival)


@dataclass
class StepPlan:
    """What one step computes: request -> tokens to compute."""

    entries: dict[SimRequest, int] = field(default_factory=dict)
    work: StepWork = field(default_factory=StepWork)
    changed: bool = False           # admissions or preemptions happened
    preempted: int = 0              # running requests preempted in this step


class SimCore:
    def __init__(
        self,
        limits: CoreLimits,
        picker: TokenPicker,
        token_text: Callable[[int], str],
        eos_token_id: int,
    ) -> None:
        self.limits = limits
        self.pool = BlockPool(limits.total_blocks)
        self._picker = picker
        self._clean_ids = picker.clean_token_ids
        self._token_text = token_text
        self._eos = eos_token_id
        self._k = limits.block_size // limits.hash_block_tokens
        self._waiting: dict[str, SimRequest] = {}
        self._heap: list[tuple[int, int, str]] = []
        self._running: dict[str, SimRequest] = {}    # admission order
        self._arrivals = 0

    # ---------------------------------------------------------------- submit / abort

    def check_capacity(self, request: GenerationRequest) -> None:
        """The sim's own rule (the runtime applied the shared ones): a request
        that could never hold all its tokens' blocks would wait forever."""
        lim = self.limits
        total = len(request.prompt_token_ids) + request.sampling.max_tokens
        need = math.ceil(total / lim.block_size)
        if need > lim.total_blocks:
            raise InvalidRequest(
                f"{total} tokens need {need} KV blocks; this engine has {lim.total_blocks}; lower max_tokens"
            )

    def add(self, request: GenerationRequest) -> SimRequest:
        """Queue a request that passed the runtime's shared rules (so its id
        is not held here); raises InvalidRequest if it can never fit."""
        self.check_capacity(request)
        self._arrivals += 1
        req = SimRequest(
            request_id=request.request_id,
            tokens=list(request.prompt_token_ids),
            prompt_len=len(request.prompt_token_ids),
            priority=request.priority,
            arrival=self._arrivals,
            request=request,
            sink=OutputSink(),
            stop_text=StopText(request.sampling.stop),
            rolling=roll_all(request.prompt_token_ids),
            salt=sampling_salt(request.sampling),
            script=StructuredScript(request, self._clean_ids, self._eos) if request.sampling.structured else None,
        )
        self._enqueue(req)
        return req

    def abort(self, request_id: str, message: str = "aborted") -> bool:
        req = self._waiting.pop(request_id, None) or self._running.pop(request_id, None)
        if req is None:
            return False
        self._finish(req, FinishReason.ABORT, message)
        return True

    def abort_all(self, message: str) -> None:
        for request_id in [*self._running, *self._waiting]:
            self.abort(request_id, message)

    # ---------------------------------------------------------------- views

    def has_work(self) -> bool:
        return bool(self._running or self._waiting)

    def load(self) -> LoadSnapshot:
        # "Prompt tokens not yet prefilled" (the proto's meaning): a waiting
        # request's cached prefix will not be prefilled, so it does not count.
        # Counting whole prompts made a warm engine under shared-prefix load
        # look ~20x busier than it is, and sticky placement spilled requests
        # to cold engines (a full prefill each): found by the router
        # comparison in BENCHMARKS.md ("Routers side by side").
        bs = self.limits.block_size
        queued = sum(len(r.tokens) - len(self._prefix_hit(r)) * bs for r in self._waiting.values()) + sum(
            max(0, len(r.tokens) - 1 - r.num_computed) for r in self._running.values()
        )
        return LoadSnapshot(
            running=len(self._running),
            waiting=len(self._waiting),
            blocks_used=self.pool.used,
            blocks_total=self.limits.total_blocks,
            cached_blocks=self.pool.cached_blocks,
            queued_tokens=queued,
            request_ids=[*self._running, *self._waiting],
        )

    def set_listener(self, listener: KvListener | None) -> None:
        self.pool.set_listener(listener)

    # ---------------------------------------------------------------- schedule

    def schedule(self) -> StepPlan:
        plan = StepPlan()
        budget = self._schedule_running(plan, self.limits.chunk_tokens)
        if not plan.changed:  # no admissions in a step that had to preempt
            self._schedule_waiting(plan, budget)
        prefill = decode = context = 0
        for req, n in plan.entries.items():
            if req.generated and len(req.tokens) - req.num_computed == 1:
                decode += 1
                context += req.num_computed + 1
            else:
                prefill += n
        plan.work = StepWork(prefill, decode, context)
        return plan

    def _schedule_running(self, plan: StepPlan, budget: int) -> int:
        for req in list(self._running.values()):
            if budget <= 0:
                break
            if req.state is not RequestState.RUNNING:
                continue  # preempted earlier in this loop
            n = min(len(req.tokens) - req.num_computed, budget)
            while not self._grow(req, n):
                victim = max(self._running.values(), key=SimRequest.sort_key)
                budget += plan.entries.pop(victim, 0)
                self._preempt(victim)
                plan.changed = True
                plan.preempted += 1
                if victim is req:
                    break
            else:
                plan.entries[req] = n
                budget -= n
        return budget

    def _schedule_waiting(self, plan: StepPlan, budget: int) -> None:
        bs = self.limits.block_size
        while budget > 0 and len(self._running) < self.limits.max_running:
            req = self._peek_waiting()
            if req is None:
                return
            hit = self._prefix_hit(req)
            hit_tokens = len(hit) * bs
            n = min(len(req.tokens) - hit_tokens, budget)
            need = math.ceil((hit_tokens + n) / bs) - len(hit)
            if need > self.pool.free - self.pool.evictable_among(hit):
                return  # head of line waits for blocks; nothing behind it jumps
            heapq.heappop(self._heap)
            del self._waiting[req.request_id]
            self.pool.touch(hit)
            req.blocks = hit + self.pool.allocate(need)
            req.num_computed = hit_tokens
            if req.num_cached is None:
                req.num_cached = hit_tokens
            req.state = RequestState.RUNNING
            self._running[req.request_id] = req
            plan.entries[req] = n
            plan.changed = True
            budget -= n

    def _peek_waiting(self) -> SimRequest | None:
        while self._heap:
            _, _, request_id = self._heap[0]
            req = self._waiting.get(request_id)
            if req is not None and req.state is RequestState.WAITING:
                return req
            heapq.heappop(self._heap)  # aborted or re-queued entry: lazy removal
        return None

    def _prefix_hit(self, req: SimRequest) -> list[int]:
        # As vLLM: the last prompt token is always computed (it yields the
        # logits of the next token), so at most (len - 1) // block_size blocks hit.
        max_blocks = (len(req.tokens) - 1) // self.limits.block_size
        self._ensure_hashes(req, max_blocks)
        keys = [req.shared_hashes[(i + 1) * self._k - 1] for i in range(max_blocks)]
        return self.pool.lookup(keys)

    def _grow(self, req: SimRequest, n: int) -> bool:
        need = math.ceil((req.num_computed + n) / self.limits.block_size) - len(req.blocks)
        if need <= 0:
            return True
        if need > self.pool.free:
            return False
        req.blocks.extend(self.pool.allocate(need))
        return True

    def _preempt(self, req: SimRequest) -> None:
        del self._running[req.request_id]
        self.pool.release(req.blocks)
        req.blocks = []
        req.num_computed = 0
        self._enqueue(req)

    def _enqueue(self, req: SimRequest) -> None:
        req.state = RequestState.WAITING
        self._waiting[req.request_id] = req
        heapq.heappush(self._heap, (req.priority, req.arrival, req.request_id))

    # ---------------------------------------------------------------- apply

    def apply(self, plan: StepPlan) -> bool:
        """Account the step's computed tokens; True if a request finished."""
        finished = False
        for req, n in plan.entries.items():
            if req.state is not RequestState.RUNNING:
                continue  # aborted while the step ran
            before = req.num_computed
            req.num_computed += n
            self._cache_full_blocks(req, before)
            if req.num_computed == len(req.tokens):
                finished |= self._sample(req)
        return finished

    def _cache_full_blocks(self, req: SimRequest, before: int) -> None:
        bs = self.limits.block_size
        first, last = before // bs, req.num_computed // bs
        if first == last:
            return
        self._ensure_hashes(req, last)
        for i in range(first, last):
            hashes = tuple(req.shared_hashes[i * self._k : (i + 1) * self._k])
            self.pool.cache(req.blocks[i], hashes[-1], hashes)

    def _ensure_hashes(self, req: SimRequest, blocks: int) -> None:
        """Shared-space hashes of the first `blocks` engine blocks of req."""
        hb = self.limits.hash_block_tokens
        want = blocks * self._k
        have = len(req.shared_hashes)
        parent = req.shared_hashes[-1] if have else ROOT_HASH
        for j in range(have, want):
            parent = chain_hash(parent, req.tokens[j * hb : (j + 1) * hb])
            req.shared_hashes.append(parent)

    def _pick(self, req: SimRequest) -> tuple[int, str]:
        """The next token and its text: the structured script's, else the
        picker's (logit_bias at +-100 forces or bans a token)."""
        if req.script is not None:
            return req.script.next()
        bias = req.request.sampling.logit_bias
        state = roll(req.rolling, req.salt) if req.salt else req.rolling
        token = biased(self._picker, state, bias) if bias else self._picker.next_token(state)
        return token, self._token_text(token)

    def _sample(self, req: SimRequest) -> bool:
        token, token_text = self._pick(req)
        req.tokens.append(token)
        req.rolling = roll(req.rolling, token)
        req.generated += 1
        sampling = req.request.sampling
        may_stop = req.generated >= sampling.min_tokens
        is_eos = token == self._eos and not sampling.ignore_eos
        stop_id = token in sampling.stop_token_ids
        text = "" if (is_eos or stop_id) and may_stop else token_text
        text, stop_str = req.stop_text.add(text)
        stop_str = stop_str and may_stop
        req.sink.push(token, text, self._logprob(token, text) if sampling.logprobs is not None else None,
                      req.stop_text.held)
        if may_stop and (is_eos or stop_id or stop_str):
            self._finish(req, FinishReason.STOP)
        elif req.generated >= sampling.max_tokens:
            self._finish(req, FinishReason.LENGTH)
        else:
            return False
        del self._running[req.request_id]
        return True

    def _logprob(self, token: int, text: str) -> dict:
        # The sim is greedy and certain: the chosen token has probability 1.
        return {"token_id": token, "token": text, "logprob": 0.0,
                "top": [{"token_id": token, "token": text, "logprob": 0.0}]}

    def _finish(self, req: SimRequest, reason: FinishReason, message: str = "") -> None:
        self.pool.release(req.blocks)
        req.blocks = []
        req.state = RequestState.FINISHED
        resumed = req.request.resumed_tokens
        req.sink.finish(GenerationOutput(
            token_ids=[],
            text=req.stop_text.flush(),  # empty after a stop string: it was cut
            finish_reason=reason,
            prompt_tokens=max(0, req.prompt_len - resumed),
            cached_tokens=min(req.num_cached or 0, req.prompt_len),
            completion_tokens=resumed + req.generated,
            message=message,
        ))
