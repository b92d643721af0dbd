"""Lossless preemption, seen from the gateway: the scheduler says `Preempted`
on a running request's Admit stream; the gateway stops the engine stream,
answers `Requeue` (prompt + generated), keeps the client's stream open
(heartbeats, no queue positions after the first token) and continues where
the request is placed next, from exactly the next token. The fake model is
deterministic, so the client's tokens and text must equal an uninterrupted
run's."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import openai
import pytest
from conftest import (
    KEY_FULL,
    KEY_SHORT,
    MODEL,
    FakeEngine,
    FakeScheduler,
    Mesh,
    expected_answer,
    open_mesh,
    token_text,
)

from services.common.prefix_hash import block_hashes
from services.common.proto.kvmesh.v1 import (
    common_pb2,
    inference_pb2,
    inference_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
)

MAX_TOKENS = 20
CHAT = inference_pb2.ChatRequest(
    model=MODEL, messages=[inference_pb2.ChatMessage(role="user", content="hello world")],
    sampling=common_pb2.SamplingParams(max_tokens=MAX_TOKENS),
)


def _metrics(mesh: Mesh) -> str:
    return mesh.gateway.metrics.render().decode()


async def _chat(mesh: Mesh, preempt_at: list[int], key: str = KEY_FULL) -> list[inference_pb2.GenerateEvent]:
    """Chat over gRPC; preempt the request each time the client has seen
    the next count of tokens in `preempt_at` (the fake engine pauses there)."""
    pending = list(preempt_at)
    events: list[inference_pb2.GenerateEvent] = []
    seen = 0
    async with grpc.aio.insecure_channel(mesh.grpc_address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        async for event in stub.Chat(CHAT, metadata=(("authorization", f"Bearer {key}"),)):
            events.append(event)
            seen += len(event.delta.token_ids)
            while pending and seen >= pending[0]:
                pending.pop(0)
                await mesh.scheduler.preempt(mesh.scheduler.admits[-1])
    return events


def _answer(events: list[inference_pb2.GenerateEvent]) -> tuple[list[int], str]:
    deltas = [e.delta for e in events if e.HasField("delta")]
    return [t for d in deltas for t in d.token_ids], "".join(d.text for d in deltas)


def _kinds(events: list[inference_pb2.GenerateEvent]) -> list[str]:
    return [str(e.WhichOneof("event")) for e in events]


async def _preempt_when_paused(mesh: Mesh, engine: FakeEngine, settle: float = 0.0) -> None:
    await asyncio.wait_for(engine.paused.wait(), 10)
    await asyncio.sleep(settle)  # the gateway has read what the engine sent
    await mesh.scheduler.preempt(mesh.scheduler.admits[-1])


async def test_preempted_stream_continues_on_another_engine_seamlessly(mesh: Mesh) -> None:
    a = mesh.engines["engine-a"]
    a.answer_tokens, a.pause_after = 12, 4
    b = await mesh.add_engine(FakeEngine("engine-b", answer_tokens=12))
    scheduler = mesh.scheduler
    scheduler.requeue_engines, scheduler.requeue_queued = ["engine-b"], 2
    scheduler.requeue_hold = asyncio.Event()
    asyncio.get_running_loop().call_later(0.7, scheduler.requeue_hold.set)  # heartbeats meanwhile
    events = await _chat(mesh, [4])

    prompt = list(a.requests[0].prompt_token_ids)
    ids, text = expected_answer(prompt, 12)
    assert _answer(events) == (ids, text)
    kinds = _kinds(events)
    after_first = kinds[kinds.index("delta"):]
    assert "queued" not in after_first
    assert "heartbeat" in after_first[:after_first.index("finished")]
    assert events[-1].finished.usage.completion_tokens == 12
    # The engine stream was stopped; Requeue describes the request as it stands.
    await asyncio.wait_for(a.cancelled.wait(), 10)
    record = scheduler.admits[0]
    requeue = record.requeues[0]
    assert requeue.prompt_tokens == len(prompt) + 4 and requeue.max_tokens == MAX_TOKENS - 4
    assert list(requeue.prefix_hashes) == block_hashes(prompt + ids[:4], mesh.config.hash_block_tokens)
    # Engine B continued from exactly the next token, like a migration.
    resumed = b.requests[0]
    assert list(resumed.prompt_token_ids) == prompt + ids[:4] and resumed.resumed_tokens == 4
    assert resumed.sampling.max_tokens == MAX_TOKENS - 4
    assert (await record.wait_done()).completion_tokens == 12
    assert record.messages == ["first_token", "requeue", "first_token", "done"] and not record.replaces
    text_metrics = _metrics(mesh)
    assert 'kvmesh_gateway_preemptions_total{priority="P1"} 1.0' in text_metrics
    assert 'kvmesh_gateway_preempted_seconds_count{priority="P1"} 1.0' in text_metrics
    assert "kvmesh_gateway_migrations_total 0.0" in text_metrics


async def test_preempted_twice_uses_no_migration(model_dir: Path) -> None:
    """max_migrations 0: a failed engine would end the stream, two
    preemptions do not; the second continues on the first engine again."""
    async with open_mesh(model_dir, max_migrations=0) as mesh:
        a = mesh.engines["engine-a"]
        a.answer_tokens, a.pause_after = 12, 3
        b = await mesh.add_engine(FakeEngine("engine-b", answer_tokens=12))
        b.pause_after = 4
        mesh.scheduler.requeue_engines = ["engine-b", "engine-a"]
        events = await _chat(mesh, [3, 7])
        prompt = list(a.requests[0].prompt_token_ids)
        assert _answer(events) == expected_answer(prompt, 12)
        assert events[-1].finished.finish_reason == common_pb2.FINISH_REASON_STOP
        assert [r.resumed_tokens for r in (*a.requests, *b.requests)] == [0, 7, 3]
        record = mesh.scheduler.admits[0]
        assert [r.prompt_tokens for r in record.requeues] == [len(prompt) + 3, len(prompt) + 7]
        assert [r.max_tokens for r in record.requeues] == [MAX_TOKENS - 3, MAX_TOKENS - 7]
        assert (await record.wait_done()).completion_tokens == 12
        assert 'kvmesh_gateway_preemptions_total{priority="P1"} 2.0' in _metrics(mesh)


async def test_preempted_before_the_first_token(mesh: Mesh) -> None:
    """Nothing generated yet: Requeue carries the prompt alone, and queue
    positions still go to the client (no token was sent)."""
    a = mesh.engines["engine-a"]
    a.pause_after = 0
    mesh.scheduler.requeue_queued = 2
    preempting = asyncio.create_task(_preempt_when_paused(mesh, a))
    events = await _chat(mesh, [])
    await preempting
    prompt = list(a.requests[0].prompt_token_ids)
    assert _answer(events) == expected_answer(prompt, 6)
    assert _kinds(events).count("queued") == 3  # one at admission, two after the requeue
    requeue = mesh.scheduler.admits[0].requeues[0]
    assert requeue.prompt_tokens == len(prompt) and requeue.max_tokens == MAX_TOKENS
    assert list(requeue.prefix_hashes) == block_hashes(prompt, mesh.config.hash_block_tokens)
    assert a.requests[1].resumed_tokens == 0 and list(a.requests[1].prompt_token_ids) == prompt


async def test_preempted_crossing_done_is_ignored(mesh: Mesh) -> None:
    mesh.scheduler.preempt_on = {"done"}
    events = await _chat(mesh, [])
    prompt = list(mesh.engines["engine-a"].requests[0].prompt_token_ids)
    assert _answer(events) == expected_answer(prompt, 6)
    record = mesh.scheduler.admits[0]
    assert (await record.wait_done()).completion_tokens == 6
    await asyncio.sleep(0.1)
    assert record.messages == ["first_token", "done"] and not record.requeues
    assert len(mesh.engines["engine-a"].requests) == 1


async def test_preempted_as_the_engine_finishes_loses_nothing(mesh: Mesh) -> None:
    """`Preempted` on the first token of a short answer races the engine's
    `finished`: whichever wins, the client gets the answer exactly once."""
    a = mesh.engines["engine-a"]
    a.answer_tokens = 3
    mesh.scheduler.preempt_on = {"first_token"}
    events = await _chat(mesh, [])
    prompt = list(a.requests[0].prompt_token_ids)
    assert _answer(events) == expected_answer(prompt, 3)
    assert events[-1].finished.usage.completion_tokens == 3
    assert (await mesh.scheduler.admits[0].wait_done()).completion_tokens == 3


async def test_stop_string_across_the_preemption_seam_still_stops(mesh: Mesh) -> None:
    """Engine A holds back the start of a stop string when it is preempted;
    the stop string ends in the first token after the seam."""
    a = mesh.engines["engine-a"]
    a.answer_tokens = 9
    async with openai.AsyncOpenAI(base_url=f"{mesh.http}/v1", api_key=KEY_FULL, max_retries=0, timeout=20) as c:
        messages = [{"role": "user", "content": "hello world"}]
        await c.chat.completions.create(model=MODEL, messages=messages, max_tokens=9)  # type: ignore[arg-type]  # plain dicts for the SDK's message TypedDicts
        prompt = list(a.requests.pop().prompt_token_ids)
        pieces = [token_text(t) for t in expected_answer(prompt, 9)[0]]
        m = 4                                          # preempted after 4 tokens
        stop = pieces[m - 1][-2:] + pieces[m][:3]
        full = "".join(pieces)
        seam_at = len("".join(pieces[:m])) - 2
        assert full.find(stop) == seam_at, "the probe answer repeats the stop string earlier; pick another"
        a.pause_after = m
        preempting = asyncio.create_task(_preempt_when_paused(mesh, a, settle=0.2))
        stream = await c.chat.completions.create(  # type: ignore[call-overload]  # plain dicts for the SDK's message TypedDicts
            model=MODEL, messages=messages, stream=True, stop=[stop], stream_options={"include_usage": True})
        chunks = [ch async for ch in stream]
        await preempting
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    reasons = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert text == full[:seam_at] and reasons[-1] == "stop"
    assert chunks[-1].usage.completion_tokens == m + 1
    assert a.requests[1].resumed_tokens == m


async def test_rejected_after_requeue_ends_the_stream(mesh: Mesh) -> None:
    a = mesh.engines["engine-a"]
    a.answer_tokens, a.pause_after = 12, 2
    mesh.scheduler.requeue_reject = scheduler_pb2.Rejected(
        code=scheduler_pb2.REJECT_CODE_EXPIRED, message="waited too long", retry_after_seconds=2)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await _chat(mesh, [2])
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_max_generation_seconds_bounds_the_wait_after_a_preemption(mesh: Mesh) -> None:
    a = mesh.engines["engine-a"]
    a.answer_tokens, a.pause_after = 12, 2
    mesh.scheduler.requeue_hold = asyncio.Event()  # never placed again
    events = await _chat(mesh, [2], key=KEY_SHORT)  # 0.3 s for the whole generation
    assert events[-1].finished.finish_reason == common_pb2.FINISH_REASON_TIMEOUT
    assert _answer(events)[0] == expected_answer(list(a.requests[0].prompt_token_ids), 2)[0]
    assert (await mesh.scheduler.admits[0].wait_done()).finish_reason == "timeout"


async def test_the_derived_generation_limit_does_not_count_the_wait_after_a_preemption(mesh: Mesh) -> None:
    # At 4x overload a P2 preempted and requeued behind P0/P1 work waited past
    # the fleet's derived limit and ended `timeout` (bench_priorities.py).
    a = mesh.engines["engine-a"]
    a.answer_tokens, a.pause_after = 12, 2
    mesh.scheduler.generation_seconds = 0.5
    mesh.scheduler.requeue_hold = asyncio.Event()
    asyncio.get_running_loop().call_later(1.2, mesh.scheduler.requeue_hold.set)
    events = await _chat(mesh, [2])
    assert events[-1].finished.finish_reason != common_pb2.FINISH_REASON_TIMEOUT, events[-1].finished.message
    assert _answer(events) == expected_answer(list(a.requests[0].prompt_token_ids), 12)
    assert events[-1].finished.usage.completion_tokens == 12


async def test_the_derived_generation_limit_does_not_count_the_wait_for_a_replacement(mesh: Mesh) -> None:
    # A stream whose engine died waits for its model's last engine to restart
    # (scheduler.engine_return_seconds); that wait is not the generation's time.
    a = mesh.engines["engine-a"]
    a.answer_tokens, a.break_after = 12, 3
    await mesh.add_engine(FakeEngine("engine-b", answer_tokens=12))
    mesh.scheduler.generation_seconds, mesh.scheduler.replace_delay = 0.5, 1.2
    events = await _chat(mesh, [])
    assert events[-1].finished.finish_reason != common_pb2.FINISH_REASON_TIMEOUT, events[-1].finished.message
    assert _answer(events) == expected_answer(list(a.requests[0].prompt_token_ids), 12)


async def test_the_derived_generation_limit_still_ends_a_generation_that_runs_past_it(mesh: Mesh) -> None:
    a = mesh.engines["engine-a"]
    a.answer_tokens, a.token_delay = 12, 0.1  # ~1.2 s on its engine
    mesh.scheduler.generation_seconds = 0.5
    events = await _chat(mesh, [])
    assert events[-1].finished.finish_reason == common_pb2.FINISH_REASON_TIMEOUT
    assert "0.5s limit" in events[-1].finished.message


async def test_scheduler_restart_while_preempted_readmits_prompt_and_generated(mesh: Mesh) -> None:
    a = mesh.engines["engine-a"]
    a.answer_tokens, a.pause_after = 12, 5
    mesh.scheduler.requeue_hold = asyncio.Event()  # the first scheduler never places it again
    chat = asyncio.create_task(_chat(mesh, [5]))

    async def requeued() -> None:
        while not (mesh.scheduler.admits and mesh.scheduler.admits[0].requeues):
            await asyncio.sleep(0.02)
    await asyncio.wait_for(requeued(), 10)
    await mesh.servers[0].stop(0)
    restarted = FakeScheduler()
    restarted.engines = dict(mesh.scheduler.engines)
    server = grpc.aio.server()
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(restarted, server)
    assert server.add_insecure_port(mesh.config.gateway.scheduler_address)
    await server.start()
    mesh.servers.append(server)
    events = await asyncio.wait_for(chat, 30)
    prompt = list(a.requests[0].prompt_token_ids)
    assert _answer(events) == expected_answer(prompt, 12)
    again = restarted.admits[0].request
    first = mesh.scheduler.admits[0].request
    assert again.prompt_tokens == len(prompt) + 5 and again.max_tokens == MAX_TOKENS - 5
    assert again.arrival_unix == first.arrival_unix and not again.running_on_engine
    assert a.requests[1].resumed_tokens == 5
