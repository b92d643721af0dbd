"""The floor: a benchmark run's own requests replayed through the simulator's
cost model on an ideal fleet, so a router's figures can be read as a distance
to the physical limit, not only to other routers.

`floor_summary(results, engine, engines, tokenizer_dir)` takes every request
the run sent (`RequestResult.messages`, its start offset, its output length)
and replays it in virtual time -- a discrete-event simulation, nothing sleeps;
3,000 requests of 3k tokens on 8 engines in 0.5 s here, 1.8 s at 4x overload
-- through `services/engine/sim/cost_model.py`'s
`step_seconds` with the engine's `SimCostConfig`, chunk budget, batch cap
(`max_running`) and block size, on `engines` identical engines. The result has
the shape of `stats.summarize(...)["overall"]` plus `per_engine`.

What the replay assumes (the ideal fleet):
  * Exact prompts: the chat rendered and tokenized by services/common/tokenizer.py,
    the module the gateway and the engines' own endpoints use, so the token
    ids (and so the block-aligned prefixes) are the ones the engines saw.
  * Unbounded, fleet-wide prefix cache: a full 16-token block is cached from
    the end of the step that computed it, on every engine, forever. At
    admission a request hits the longest chain of cached full blocks of its
    prompt, at most (len - 1) // block_size of them (the last prompt token is
    always computed, as in sim/core.py and vLLM). KV never runs out, so
    nothing is evicted or preempted. With `kv_bounded` (a tighter bound
    under cache pressure) the cache is instead the fleet's own KV,
    engines x total_blocks blocks pooled fleet-wide, evicting by Belady's
    MIN (services/bench/floor_kv.py says why that bounds any router).
  * The sim's step loop per engine (sim/core.py): each step gives running
    requests a prefill chunk or one decode token, in admission order, within
    `chunk_tokens`; then admits waiting requests in arrival order while the
    batch has room (`max_running`) and budget. A request's first token is
    sampled at the end of the step that computes its last prompt token. An
    idle engine starts a step when a request arrives.
  * Oracle placement: each request goes to the engine where its first token
    is predicted soonest: the rest of the engine's current step, then its
    queued prefill (running and waiting requests' uncached remainders) plus
    this request's own, in `chunk_tokens` steps of the engine's current
    batch, plus a wait for a slot when the batch is full.
  * No path cost: no client, network, router, tokenization or scheduling time.
  * Output lengths: the tokens each request actually got (its max_tokens if it
    failed), which the benchmark makes exact (ignore_eos).

Why it is a floor, and where only a tight approximation: against the same
sim engines every router pays at least these costs -- the same cost model,
no cheaper cache than an unbounded shared one (a hit can only shorten a
prefill), no path cost, and placement that looks at every engine's real
queue. It is not a proof of optimality in two places: the placement is
greedy (earliest predicted first token for this request, not a joint
optimum over all requests: a router that delays one request could in
principle speed up others), and a request never waits for another engine's
in-flight prefill of its prefix (it computes it again, as the sim would);
both can only make the floor higher than a clairvoyant optimum, by at most a
few steps per affected request. A router also cannot reorder an engine's
queue (the sim admits FCFS), so FCFS here is the engines' own rule, not an
assumption.
"""

from __future__ import annotations

import heapq
import math
import re
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.bench.floor_kv import PooledKv, UnboundedKv
from services.bench.stats import RequestResult, percentiles
from services.common.config import EngineConfig
from services.common.tokenizer import HfTokenizer
from services.engine.sim.cost_model import StepWork, step_seconds

__all__ = ["FloorRequest", "FloorOutcome", "floor_summary", "prompt_ids", "replay", "summarize_floor"]


@dataclass(frozen=True)
class FloorRequest:
    start: float            # seconds after the run's start
    prompt: tuple[int, ...]
    output_tokens: int      # >= 1
    # The output's ids where known (the next turn's prompt resends them): their
    # blocks are cached like the prompt's, as the sim caches generated tokens.
    generated: tuple[int, ...] = ()


@dataclass
class FloorOutcome:
    engine: int = -1
    ttft: float | None = None
    e2e: float | None = None
    cached_tokens: int = 0


@dataclass(eq=False)
class _Live:
    index: int
    req: FloorRequest
    hashes: list[int]           # chain hash of each full block of the prompt
    computed: int = 0           # tokens whose KV exists
    length: int = 0             # prompt + generated tokens
    generated: int = 0
    rank: int = 0               # position in arrival order
    pinned: list[int] = field(default_factory=list)  # cached blocks it holds while running


@dataclass
class _Engine:
    index: int
    running: list[_Live] = field(default_factory=list)
    waiting: deque[_Live] = field(default_factory=deque)
    busy_until: float | None = None   # end of the current step; None = idle
    plan: list[tuple[_Live, int]] = field(default_factory=list)
    placed: int = 0


def _block_hashes(prompt: tuple[int, ...], block: int) -> list[int]:
    out, parent = [], 0
    for i in range(len(prompt) // block):
        parent = hash((parent, prompt[i * block:(i + 1) * block]))
        out.append(parent)
    return out


class _Fleet:
    """The ideal fleet's state; `replay` drives it in time order."""

    def __init__(self, engine: EngineConfig, engines: int, requests: Sequence[FloorRequest],
                 warm: Sequence[tuple[int, ...]], kv_blocks: int | None) -> None:
        self.cost = engine.sim
        self.block = engine.block_size
        self.chunk = engine.sim.chunk_tokens
        self.max_running = engine.max_running
        self.engines = [_Engine(i) for i in range(engines)]
        self.out = [FloorOutcome() for _ in requests]
        self.events: list[tuple[float, int, int, int]] = []  # (time, seq, kind 0=arrival 1=step end, index)
        self.seq = 0
        for i, r in enumerate(requests):
            self._push(r.start, 0, i)
        order = sorted(range(len(requests)), key=lambda i: requests[i].start)
        self.live = {i: _Live(i, requests[i], _block_hashes(requests[i].prompt + requests[i].generated, self.block),
                              length=len(requests[i].prompt), rank=rank) for rank, i in enumerate(order)}
        warm_blocks = [(h, d) for prompt in warm for d, h in enumerate(_block_hashes(prompt, self.block))]
        self.kv = (UnboundedKv(h for h, _ in warm_blocks) if kv_blocks is None
                   else PooledKv(kv_blocks, self._uses(), warm_blocks))

    def _uses(self) -> dict[int, list[int]]:
        """Block -> ranks of the requests whose prompt could hit it, ascending."""
        uses: dict[int, list[int]] = {}
        for x in sorted(self.live.values(), key=lambda x: x.rank):
            for h in x.hashes[:self._limit(x)]:
                uses.setdefault(h, []).append(x.rank)
        return uses

    def _limit(self, live: _Live) -> int:
        return (len(live.req.prompt) - 1) // self.block

    def _push(self, t: float, kind: int, index: int) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, index))

    def _hit_blocks(self, live: _Live) -> int:
        limit = self._limit(live)
        n = 0
        while n < limit and live.hashes[n] in self.kv:
            n += 1
        return n

    def _uncached(self, live: _Live) -> int:
        if live.computed or live.generated:  # admitted: its remaining prefill
            return max(0, len(live.req.prompt) - live.computed)
        return len(live.req.prompt) - self._hit_blocks(live) * self.block

    def _predicted_first_token(self, e: _Engine, now: float, own: int) -> float:
        """When this request's first token would come on e (oracle placement)."""
        rest = 0.0 if e.busy_until is None else e.busy_until - now
        queued = sum(self._uncached(x) for x in e.running) + sum(self._uncached(x) for x in e.waiting)
        batch = len(e.running) + len(e.waiting)
        decoding = sum(1 for x in e.running if x.generated)
        step = step_seconds(self.cost, StepWork(self.chunk, decoding, 0))
        t = rest + math.ceil((queued + own) / self.chunk) * step
        if batch >= self.max_running:  # a slot frees when the first running request ends
            left = min(x.req.output_tokens - x.generated for x in e.running)
            t += left * step_seconds(self.cost, StepWork(0, max(1, decoding), 0))
        return t

    def arrive(self, index: int, now: float) -> None:
        live = self.live[index]
        own = self._uncached(live)
        e = min(self.engines, key=lambda x: (self._predicted_first_token(x, now, own), x.placed, x.index))
        e.placed += 1
        self.out[index].engine = e.index
        e.waiting.append(live)
        if e.busy_until is None:
            self._step(e, now)

    def _step(self, e: _Engine, now: float) -> None:
        """Schedule one step of e at `now` (sim/core.py's order, no blocks)."""
        budget, plan = self.chunk, []
        for x in e.running:
            if budget <= 0:
                break
            n = min(x.length - x.computed, budget)
            plan.append((x, n))
            budget -= n
        while budget > 0 and e.waiting and len(e.running) < self.max_running:
            x = e.waiting.popleft()
            hit = self._hit_blocks(x)
            x.computed = hit * self.block
            x.pinned = x.hashes[:hit]
            self.kv.pin(x.pinned)
            self.kv.admitted(x.rank, x.hashes[:self._limit(x)])
            self.out[x.index].cached_tokens = x.computed
            n = min(x.length - x.computed, budget)
            e.running.append(x)
            plan.append((x, n))
            budget -= n
        decode = {x for x, _ in plan if x.generated and x.length - x.computed == 1}
        work = StepWork(sum(n for x, n in plan if x not in decode), len(decode),
                        sum(x.computed + 1 for x in decode))
        e.plan = plan
        e.busy_until = now + step_seconds(self.cost, work)
        self._push(e.busy_until, 1, e.index)

    def step_end(self, e: _Engine, now: float) -> None:
        for x, n in e.plan:
            before, x.computed = x.computed, x.computed + n
            known = len(x.req.prompt) + len(x.req.generated)
            for b in range(before // self.block, min(x.computed, known) // self.block):
                self.kv.add(x.hashes[b], b)
                self.kv.pin(x.hashes[b:b + 1])
                x.pinned.append(x.hashes[b])
            if x.computed < x.length:
                continue
            x.generated += 1
            x.length += 1
            result = self.out[x.index]
            if x.generated == 1:
                result.ttft = now - x.req.start
            if x.generated >= x.req.output_tokens:
                result.e2e = now - x.req.start
                e.running.remove(x)
                self.kv.unpin(x.pinned)
        if isinstance(self.kv, PooledKv):  # running requests' partial and unhashed blocks take room too
            self.kv.trim(sum(-(-x.computed // self.block) - len(x.pinned) for f in self.engines for x in f.running))
        e.plan = []
        e.busy_until = None
        if e.running or e.waiting:
            self._step(e, now)


def replay(requests: Sequence[FloorRequest], engine: EngineConfig, engines: int,
           warm: Sequence[tuple[int, ...]] = (), kv_blocks: int | None = None) -> list[FloorOutcome]:
    """Each request's engine, TTFT, end-to-end time and cached prompt tokens
    on the ideal fleet (module docstring), the prompts in `warm` cached from
    the start; same order as `requests`. `kv_blocks`: the prefix cache is
    that many blocks pooled fleet-wide with clairvoyant eviction
    (floor_kv.PooledKv) instead of unbounded."""
    if engines <= 0:
        raise ValueError("engines must be >= 1")
    fleet = _Fleet(engine, engines, requests, warm, kv_blocks)
    while fleet.events:
        now, _, kind, index = heapq.heappop(fleet.events)
        if kind == 0:
            fleet.arrive(index, now)
        else:
            fleet.step_end(fleet.engines[index], now)
    return fleet.out


class _PromptIds:
    """Chat -> prompt token ids as the gateway makes them (HfTokenizer.chat_prompt),
    with each text segment between special tokens tokenized once: a
    byte-level BPE tokenizes those segments independently, and a run resends
    the same contexts and histories thousands of times (a 3.5k-token prompt
    costs ~4 ms here). Checked against chat_prompt on the first prompts;
    any difference turns the cache off."""

    def __init__(self, tokenizer_dir: Path) -> None:
        self.tok = HfTokenizer(tokenizer_dir)
        specials = sorted(self.tok.token_strs(sorted(self.tok.special_token_ids())), key=len, reverse=True)
        self.split = re.compile("(" + "|".join(re.escape(s) for s in specials if s) + ")") if specials else None
        self.memo: dict[str, list[int]] = {}
        self.checks = 8

    def __call__(self, messages: Sequence[dict[str, Any]]) -> tuple[int, ...]:
        if self.split is None or self.checks < 0:
            return tuple(self.tok.chat_prompt(messages).token_ids)
        text = self.tok.render_chat(messages)
        ids: list[int] = []
        for piece in self.split.split(text):
            if piece:
                if piece not in self.memo:
                    self.memo[piece] = self.tok.encode(piece, add_special_tokens=False)
                ids.extend(self.memo[piece])
        if self.checks > 0:
            self.checks -= 1
            exact = self.tok.chat_prompt(messages).token_ids
            if exact != ids:
                self.checks = -1
                return tuple(exact)
        return tuple(ids)


def prompt_ids(tokenizer_dir: Path) -> Any:
    """A callable: chat messages -> the prompt's token ids (the gateway's)."""
    return _PromptIds(tokenizer_dir)


def summarize_floor(requests: Sequence[FloorRequest], outcomes: Sequence[FloorOutcome],
                    engines: int) -> dict[str, Any]:
    """stats.summarize(...)["overall"]'s shape for the replay, plus per_engine."""
    ends = [r.start + o.e2e for r, o in zip(requests, outcomes) if o.e2e is not None]
    duration = max(ends, default=0.0)
    prompt = sum(len(r.prompt) for r in requests)
    cached = sum(o.cached_tokens for o in outcomes)
    out_tokens = sum(r.output_tokens for r in requests)
    itl = [(o.e2e - o.ttft) / (r.output_tokens - 1) for r, o in zip(requests, outcomes)
           if o.e2e is not None and o.ttft is not None and r.output_tokens > 1]
    per_engine = [0] * engines
    for o in outcomes:
        per_engine[o.engine] += 1
    return {
        "requests": len(requests), "ok": len(requests), "rejected": 0, "failed": 0, "errors": {}, "rejections": {},
        "ttft_s": percentiles(o.ttft for o in outcomes if o.ttft is not None),
        "itl_s": percentiles(itl),
        "e2e_s": percentiles(o.e2e for o in outcomes if o.e2e is not None),
        "requests_per_s": len(requests) / duration if duration > 0 else None,
        "output_tokens_per_s": out_tokens / duration if duration > 0 else None,
        "total_tokens_per_s": (out_tokens + prompt) / duration if duration > 0 else None,
        "prompt_tokens": prompt, "cached_tokens": cached, "completion_tokens": out_tokens,
        "prefix_hit_rate": cached / prompt if prompt else None,
        "client_lateness_s": percentiles([0.0] * len(requests)),
        "per_engine": per_engine,
    }


def floor_summary(results: Sequence[RequestResult], engine: EngineConfig, engines: int,
                  tokenizer_dir: Path, warm: Sequence[RequestResult] = (),
                  kv_bounded: bool = False) -> dict[str, Any]:
    """The floor of a run (module docstring): its requests that carry the
    chat they sent, replayed on `engines` ideal copies of `engine`. `warm`:
    requests sent before the measured run (bench_peers' warm-up), whose
    prompts the ideal fleet holds from the start as the real one did.
    `kv_bounded`: the fleet's own KV (engines x engine.total_blocks blocks,
    pooled, Belady eviction: floor_kv.PooledKv) instead of an unbounded cache."""
    ids = prompt_ids(tokenizer_dir)
    sent = sorted((r for r in results if r.messages), key=lambda r: r.start)
    prompts = {(r.conversation, r.turn): ids(r.messages) for r in sent}
    requests = []
    for r in sent:
        prompt, out = prompts[(r.conversation, r.turn)], max(1, r.completion_tokens if r.ok else r.max_tokens)
        after = prompts.get((r.conversation, r.turn + 1), ())
        generated = after[len(prompt):len(prompt) + out] if after[:len(prompt)] == prompt else ()
        requests.append(FloorRequest(r.start, prompt, out, generated))
    cached = [ids(r.messages) for r in warm if r.messages]
    kv_blocks = engines * engine.total_blocks if kv_bounded else None
    return summarize_floor(requests, replay(requests, engine, engines, cached, kv_blocks), engines)
