"""SimCore: block accounting, prefix cache, eviction, priority, preemption, KV events."""

from __future__ import annotations

import pytest
from engine_helpers import RecordingListener, make_core, prompt_of, request, run_core

from services.common.prefix_hash import block_hashes
from services.engine.backend import InvalidRequest
from services.engine.sim.core import RequestState


def test_blocks_are_taken_and_given_back_and_full_blocks_stay_cached() -> None:
    core = make_core(total_blocks=16)
    req = core.add(request("a", prompt_of(40), max_tokens=10))
    core.apply(core.schedule())
    # 40 prompt tokens computed -> 3 blocks, first two full and cached.
    assert core.pool.used == 3
    assert core.pool.cached_blocks == 2
    run_core(core)
    load = core.load()
    assert load.blocks_used == 0 and load.running == 0 and load.waiting == 0
    # 40 + 10 tokens, the last one never computed: 49 computed -> 3 full blocks.
    assert load.cached_blocks == 3
    assert req.generated == 10


def test_cached_prefix_shortens_prefill_and_is_reported() -> None:
    core = make_core()
    prompt = prompt_of(100)
    core.add(request("a", prompt, max_tokens=1))
    first = core.schedule()
    assert first.work.prefill_tokens == 100
    core.apply(first)
    run_core(core)
    second_req = core.add(request("b", prompt + [5, 6, 7], max_tokens=1))
    second = core.schedule()
    # 6 full blocks (96 tokens) of the prompt are cached: only 7 tokens prefill.
    assert second.work.prefill_tokens == 7
    core.apply(second)
    run_core(core)
    assert second_req.num_cached == 96


def test_fully_cached_prompt_still_computes_its_last_token() -> None:
    core = make_core()
    prompt = prompt_of(64)
    core.add(request("a", prompt, max_tokens=2))
    run_core(core)
    req = core.add(request("b", prompt, max_tokens=2))
    plan = core.schedule()
    # As vLLM: at most (64 - 1) // 16 = 3 blocks hit, the last block recomputes.
    assert plan.work.prefill_tokens == 16
    assert req.num_cached == 48


def test_lru_eviction_keeps_the_recent_prefix_and_never_over_allocates() -> None:
    core = make_core(total_blocks=8)
    listener = RecordingListener()
    core.set_listener(listener)
    old, new = prompt_of(64, start=300), prompt_of(64, start=5000)
    core.add(request("old", old, max_tokens=1))
    run_core(core)
    core.add(request("new", new, max_tokens=1))
    run_core(core)
    assert core.pool.cached_blocks == 8  # every block holds a prefix now
    # A third prompt needs 3 blocks: evicts LRU ones, old's tail first.
    core.add(request("third", prompt_of(40, start=9000), max_tokens=1))
    plan = core.schedule()
    assert core.pool.used <= core.pool.total_blocks
    core.apply(plan)
    run_core(core)
    new_hashes = set(block_hashes(new, 16))
    assert new_hashes <= listener.held  # the most recently used prefix survived
    old_hashes = block_hashes(old, 16)
    assert old_hashes[0] in listener.held  # head kept ...
    assert not set(old_hashes[1:]) & listener.held  # ... tail evicted first
    assert listener.removed_count > 0
    assert listener.held == set(core.pool.snapshot())


def test_requests_wait_when_blocks_run_out() -> None:
    core = make_core(total_blocks=6, max_running=8)
    core.add(request("a", prompt_of(60), max_tokens=4))   # 4 blocks
    core.add(request("b", prompt_of(60, start=2000), max_tokens=4))  # needs 4 more
    core.schedule()
    load = core.load()
    assert load.running == 1 and load.waiting == 1
    assert load.blocks_used <= 6
    run_core(core)
    assert core.load().running == 0 and core.load().waiting == 0


def test_preemption_never_over_allocates_and_everything_finishes() -> None:
    core = make_core(total_blocks=4, max_running=4)
    core.add(request("hi", prompt_of(20), max_tokens=30, priority=0))
    core.add(request("lo", prompt_of(20, start=4000), max_tokens=30, priority=2))
    preempted = False
    while core.has_work():
        plan = core.schedule()
        assert core.pool.used <= core.pool.total_blocks
        preempted |= plan.changed and core.load().waiting > 0
        core.apply(plan)
    assert preempted
    assert core.load().blocks_used == 0


def test_preempted_request_yields_same_tokens() -> None:
    import asyncio

    async def tokens_of(total_blocks: int) -> list[int]:
        core = make_core(total_blocks=total_blocks, max_running=4)
        reqs = [core.add(request("hi", prompt_of(20), max_tokens=30, priority=0)),
                core.add(request("lo", prompt_of(20, start=4000), max_tokens=30, priority=2))]
        run_core(core)
        outs = [await r.sink.next() for r in reqs]
        assert all(o.finish_reason == "length" for o in outs)
        return [t for o in outs for t in o.token_ids]

    assert asyncio.run(tokens_of(4)) == asyncio.run(tokens_of(64))


def test_priority_orders_the_waiting_queue() -> None:
    core = make_core(max_running=1)
    order: list[str] = []
    core.add(request("busy", prompt_of(4), max_tokens=3, priority=1))
    core.apply(core.schedule())
    for rid, prio in (("p2", 2), ("p1-early", 1), ("p0", 0), ("p1-late", 1)):
        core.add(request(rid, prompt_of(4, start=100 + prio), max_tokens=1, priority=prio))
    while core.has_work():
        plan = core.schedule()
        order.extend(r.request_id for r in plan.entries if r.num_computed == 0 and r.request_id not in order)
        core.apply(plan)
    assert order == ["p0", "p1-early", "p1-late", "p2"]


def test_abort_frees_blocks_at_once_and_unknown_is_false() -> None:
    core = make_core()
    core.add(request("a", prompt_of(50), max_tokens=100))
    core.apply(core.schedule())
    assert core.pool.used > 0
    assert core.abort("a")
    assert core.pool.used == 0
    assert not core.abort("a")
    assert not core.abort("nope")


def test_abort_between_schedule_and_apply_is_safe() -> None:
    core = make_core()
    core.add(request("a", prompt_of(50), max_tokens=5))
    plan = core.schedule()
    core.abort("a")
    core.apply(plan)
    assert core.pool.used == 0 and not core.has_work()


def test_chunked_prefill_respects_the_token_budget() -> None:
    core = make_core(chunk_tokens=32, total_blocks=64)
    core.add(request("a", prompt_of(100), max_tokens=1))
    core.add(request("b", prompt_of(10, start=3000), max_tokens=1))
    plan = core.schedule()
    assert sum(plan.entries.values()) <= 32
    steps = run_core(core)
    assert steps >= 4


def test_request_larger_than_the_engine_is_refused() -> None:
    core = make_core(total_blocks=4)
    with pytest.raises(InvalidRequest, match="KV blocks"):
        core.add(request("x", prompt_of(60), max_tokens=10))


def test_kv_events_replay_to_the_snapshot_with_engine_blocks_of_several_hash_blocks() -> None:
    core = make_core(block_size=32, total_blocks=10)
    listener = RecordingListener()
    core.set_listener(listener)
    prompts = [prompt_of(100, start=s) for s in (300, 1300, 2300, 3300)]
    for i, p in enumerate(prompts):
        core.add(request(f"r{i}", p, max_tokens=3))
        run_core(core)
        assert listener.held == set(core.pool.snapshot())
    # Each engine block (32 tokens) reports its two 16-token hash-blocks.
    last = block_hashes(prompts[-1], 16)[:6]
    assert set(last) <= listener.held
    core.pool.clear()
    assert listener.held == set() == set(core.pool.snapshot())


def test_queued_tokens_leave_out_a_waiting_requests_cached_prefix() -> None:
    # The proto's queued_tokens = prompt tokens not yet prefilled: a cached
    # prefix will not be, so the scheduler's queue estimate must not see it.
    core = make_core()
    prompt = prompt_of(100)
    core.add(request("a", prompt, max_tokens=1))
    run_core(core)
    core.add(request("b", prompt + [5, 6, 7], max_tokens=1))
    core.add(request("c", prompt_of(40, start=2000), max_tokens=1))
    assert core.load().waiting == 2
    assert core.load().queued_tokens == (103 - 96) + 40


def test_a_running_p0_under_kv_pressure_takes_its_blocks_from_the_lowest_class() -> None:
    # A P0 admitted into the batch (the engine's p0_headroom) beside a P2, with
    # every block taken: when one of them next needs a block, the P2 yields.
    core = make_core(total_blocks=6, max_running=3)
    lo = core.add(request("lo", prompt_of(40, start=4000), max_tokens=20, priority=2))
    hi = core.add(request("hi", prompt_of(40), max_tokens=20, priority=0))
    core.apply(core.schedule())
    assert hi.state is lo.state is RequestState.RUNNING and core.pool.used == 6
    lo_preempted = False
    while hi.state is not RequestState.FINISHED:  # type: ignore[comparison-overlap]  # the state moves in run_core; mypy keeps the narrowing from before
        plan = core.schedule()
        assert hi.state is RequestState.RUNNING  # never the P0
        lo_preempted |= lo.state is RequestState.WAITING  # type: ignore[comparison-overlap]  # the state moves in run_core; mypy keeps the narrowing from before
        core.apply(plan)
    assert lo_preempted
    run_core(core)
    assert lo.state is RequestState.FINISHED and core.pool.used == 0


def test_a_waiting_p0_short_of_blocks_does_not_preempt_as_in_vllm() -> None:
    # vLLM v1's priority policy: a waiting request never preempts; the P0
    # head goes in at the first step after a running request needing a block
    # preempted the lowest-priority one.
    core = make_core(total_blocks=6, max_running=3)
    first = core.add(request("p2-first", prompt_of(40, start=4000), max_tokens=30, priority=2))
    second = core.add(request("p2-second", prompt_of(40, start=6000), max_tokens=30, priority=2))
    core.apply(core.schedule())
    hi = core.add(request("hi", prompt_of(20), max_tokens=4, priority=0))
    core.apply(core.schedule())
    assert hi.state is RequestState.WAITING and first.state is second.state is RequestState.RUNNING
    run_core(core, until=lambda: hi.state is not RequestState.WAITING)
    assert first.state is RequestState.RUNNING and second.state is RequestState.WAITING  # type: ignore[comparison-overlap]  # the state moves in run_core; mypy keeps the narrowing from before; the latest P2
    assert second.generated < 30  # preempted, not finished
    run_core(core)
    assert core.pool.used == 0
