"""The engine's P0 headroom (services/engine/batch_gate.py): with
max_running=2 and p0_headroom=1 the sim's batch is 3; two P2s run, a third
waits in the runtime, a P0 runs at once; the waiting P2 goes in when a P2
ends; cancel, stop and load reports see the runtime's waiting requests."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import pytest
from engine_helpers import engine_config, mesh_config, prompt_of, request, started

from services.engine.backend import GenerationOutput, LoadSnapshot
from services.engine.batch_gate import BatchGate
from services.engine.metrics import EngineMetrics
from services.engine.runtime import EngineRuntime, Generation
from services.engine.server import EngineService

WAIT = 10.0


@pytest.fixture(params=[1])
async def runtime(request: pytest.FixtureRequest) -> AsyncIterator[EngineRuntime]:
    engine = engine_config(max_running=2, p0_headroom=request.param, total_blocks=512)
    engine.sim.speed_factor = 0.02  # ~0.2 ms per step: a long stream takes a while
    async with started(EngineService(mesh_config(), engine)) as svc:
        yield svc.runtime


async def until(predicate: Callable[[], bool], what: str) -> None:
    async def poll() -> None:
        while not predicate():
            await asyncio.sleep(0.002)

    try:
        await asyncio.wait_for(poll(), WAIT)
    except TimeoutError:
        pytest.fail(f"timed out waiting for {what}")


class Streams:
    """Consumes generations in tasks and logs "first:<id>" / "end:<id>"."""

    def __init__(self, runtime: EngineRuntime) -> None:
        self.runtime = runtime
        self.log: list[str] = []
        self.tasks: dict[str, asyncio.Task[GenerationOutput]] = {}
        self.gens: dict[str, Generation] = {}

    def start(self, rid: str, priority: int, max_tokens: int) -> Generation:
        gen = self.runtime.open(request(rid, prompt_of(16, start=100 * len(self.gens)), max_tokens,
                                        priority=priority, ignore_eos=True))
        self.gens[rid] = gen
        self.tasks[rid] = asyncio.create_task(self._consume(gen))
        return gen

    async def _consume(self, gen: Generation) -> GenerationOutput:
        rid = gen.request.request_id
        async for out in gen.outputs():
            if out.token_ids and f"first:{rid}" not in self.log:
                self.log.append(f"first:{rid}")
            if out.finish_reason is not None:
                self.log.append(f"end:{rid}")
                return out
        raise AssertionError("no final output")

    async def end(self, rid: str) -> GenerationOutput:
        return await asyncio.wait_for(self.tasks[rid], WAIT)

    def at(self, event: str) -> int:
        return self.log.index(event)

    async def close(self) -> None:
        for gen in self.gens.values():
            gen.cancel("test over")
        await asyncio.gather(*self.tasks.values(), return_exceptions=True)


async def two_p2s_and_a_held_one(streams: Streams) -> None:
    streams.start("p2-a", 2, 600)
    streams.start("p2-b", 2, 3000)
    await until(lambda: {"first:p2-a", "first:p2-b"} <= set(streams.log), "both P2s to generate")
    streams.start("p2-held", 2, 20)
    await until(lambda: streams.runtime.gate.held_ids == ["p2-held"], "the third P2 to wait in the runtime")


async def test_a_p0_runs_at_once_and_a_held_p2_starts_when_a_p2_ends(runtime: EngineRuntime) -> None:
    streams = Streams(runtime)
    try:
        await two_p2s_and_a_held_one(streams)
        load = runtime.load()
        assert (load.running, load.waiting) == (2, 1)  # the held P2 counts as waiting
        assert "p2-held" in load.request_ids and load.queued_tokens >= 16

        streams.start("p0", 0, 4)
        assert (await streams.end("p0")).finish_reason == "length"
        assert "end:p2-a" not in streams.log and "end:p2-b" not in streams.log  # no P2 made room
        assert runtime.gate.held_ids == ["p2-held"]  # the headroom is P0's only

        assert (await streams.end("p2-held")).finish_reason == "length"
        assert streams.at("end:p2-a") < streams.at("first:p2-held")  # went in when p2-a ended
        assert "end:p2-b" not in streams.log
        exposition = runtime.metrics.exposition().decode()
        assert 'kvmesh_engine_p0_over_admissions_total{engine="engine-0",model_name="sim"} 1.0' in exposition
        assert 'kvmesh_engine_runtime_waiting{engine="engine-0",model_name="sim"} 0.0' in exposition
    finally:
        await streams.close()
    await until(lambda: runtime.live_count == 0, "every generation to be released")
    assert runtime.gate.in_backend == 0 and runtime.load().request_ids == []


@pytest.mark.parametrize("runtime", [0], indirect=True)
async def test_without_headroom_a_p0_waits_for_a_slot_first_in_line(runtime: EngineRuntime) -> None:
    streams = Streams(runtime)
    try:
        await two_p2s_and_a_held_one(streams)
        streams.start("p0", 0, 4)
        await streams.end("p0")
        await streams.end("p2-held")
        assert streams.at("end:p2-a") < streams.at("first:p0") < streams.at("first:p2-held")
    finally:
        await streams.close()


async def test_cancel_and_abort_of_a_held_request_free_it(runtime: EngineRuntime) -> None:
    streams = Streams(runtime)
    try:
        await two_p2s_and_a_held_one(streams)
        streams.gens["p2-held"].cancel("client gone")
        out = await streams.end("p2-held")
        assert out.finish_reason == "abort" and out.completion_tokens == 0
        assert runtime.gate.held_ids == [] and "p2-held" not in runtime.load().request_ids
        await until(lambda: runtime.live_count == 2, "the cancelled request to be released")

        streams.start("p2-aborted", 1, 20)
        await until(lambda: runtime.gate.held_ids == ["p2-aborted"], "the P1 to wait in the runtime")
        assert await runtime.abort("p2-aborted") is True
        assert (await streams.end("p2-aborted")).finish_reason == "abort"
        assert runtime.gate.held_ids == [] and runtime.load().waiting == 0
        # The freed places were never taken: the next P2 still waits for a slot.
        streams.start("p2-next", 2, 20)
        await until(lambda: runtime.gate.held_ids == ["p2-next"], "the next P2 to wait")
    finally:
        await streams.close()
    await until(lambda: runtime.live_count == 0, "every generation to be released")
    assert runtime.gate.in_backend == 0


async def test_stop_hands_held_requests_over_at_once(runtime: EngineRuntime) -> None:
    streams = Streams(runtime)
    try:
        streams.start("p2-a", 2, 300)
        streams.start("p2-b", 2, 400)
        await until(lambda: {"first:p2-a", "first:p2-b"} <= set(streams.log), "both P2s to generate")
        streams.start("p2-held", 2, 20)
        await until(lambda: runtime.gate.held_ids == ["p2-held"], "the third P2 to wait")
        stop = asyncio.create_task(runtime.stop(grace_seconds=WAIT))
        held = await streams.end("p2-held")
        assert held.finish_reason == "abort" and streams.gens["p2-held"].handed_over
        assert "end:p2-a" not in streams.log  # handed over before the running ones finished
        # The running ones finish within the grace and are not handed over.
        assert (await streams.end("p2-a")).finish_reason == "length"
        assert (await streams.end("p2-b")).finish_reason == "length"
        await asyncio.wait_for(stop, WAIT)
    finally:
        await streams.close()


async def test_a_draining_engine_starts_its_held_requests(runtime: EngineRuntime) -> None:
    streams = Streams(runtime)
    try:
        await two_p2s_and_a_held_one(streams)
        runtime.drain()
        assert (await streams.end("p2-held")).finish_reason == "length"
    finally:
        await streams.close()


class _Fake:
    def __init__(self, rid: str, priority: int) -> None:
        self.request = request(rid, [1, 2, 3], priority=priority)
        self.submitted = False

    def submit(self) -> None:
        self.submitted = True


def test_the_gate_releases_held_requests_in_the_order_they_were_placed() -> None:
    """Not by class: the scheduler placed them in this order after weighing
    their classes and aging; a held P2 must not wait behind every P1 that
    reaches the engine after it (its lease would time out there)."""
    metrics = EngineMetrics("m", "e", lambda: LoadSnapshot(0, 0, 0, 0, 0, 0, []))
    gate: BatchGate[_Fake] = BatchGate(lambda: 1, metrics)
    running, p2_old, p1, p2_new, p0 = (_Fake("run", 2), _Fake("p2-old", 2), _Fake("p1", 1),
                                       _Fake("p2-new", 2), _Fake("p0", 0))
    for gen in (running, p2_old, p1, p2_new, p0):
        gate.offer(gen)
    assert running.submitted and p0.submitted
    assert gate.held_ids == ["p2-old", "p1", "p2-new"] and gate.held_tokens == 9
    assert gate.withdraw(p2_new) and not gate.withdraw(p2_new)
    gate.left(running)
    assert p2_old.submitted and not p1.submitted  # placed first, goes first
    gate.left(p0)  # a P0 leaving frees no slot of the other classes
    assert not p1.submitted
    gate.left(p2_old)
    assert p1.submitted and not p2_new.submitted and gate.held_ids == []
