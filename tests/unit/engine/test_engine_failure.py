"""A dead or hung backend is the engine's failure, not a request's.

Over the real engine service with the sim backend and its fault hooks
(`crash`, `hang`): every live Generate stream ends UNAVAILABLE (what the
gateway answers by migrating), health turns NOT_SERVING, load reports say
`serving: false`, new work is refused, and the service asks to exit
(`failure()` returns; `run_until_signalled` raises ServiceFailed). One
request failing still ends only that request. The hang bound itself,
max(floor, k x p99 step interval), runs on a fake clock.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterator

import grpc
import pytest
from engine_helpers import engine_config, engine_stub, mesh_config, prompt_of, started
from grpc_health.v1 import health_pb2, health_pb2_grpc
from test_scheduler_link import FakeScheduler, start_fake

from services.common.clock import FakeClock
from services.common.config import EngineConfig
from services.common.proto.kvmesh.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from services.common.service_main import ServiceFailed, run_until_signalled
from services.engine.backend import GenerationOutput, GenerationRequest
from services.engine.liveness import HangDetector, HangPolicy, LivenessWatch
from services.engine.server import EngineService
from services.engine.sim import SimBackend

Stub = engine_pb2_grpc.EngineStub


def sim_engine(**overrides: object) -> EngineConfig:
    engine = engine_config(**overrides)
    engine.sim.speed_factor = 0.05  # ~0.4 ms a step: long streams stay live
    return engine


async def open_stream(stub: Stub, rid: str, max_tokens: int = 1000) -> grpc.aio.StreamStreamCall:
    """A Generate call that has produced its first delta."""
    call = stub.Generate()
    await call.write(engine_pb2.EngineGenerateMessage(request=engine_pb2.EngineRequest(
        request_id=rid, prompt_token_ids=prompt_of(40), sampling=common_pb2.SamplingParams(max_tokens=max_tokens))))
    first = await asyncio.wait_for(call.read(), 5)
    assert first.HasField("delta")
    return call


async def ending(
    call: grpc.aio.StreamStreamCall[engine_pb2.EngineGenerateMessage, engine_pb2.EngineGenerateEvent],
) -> tuple[grpc.StatusCode, str, int]:
    """How the stream ends: (status code, details, finish reason) -- OK and
    the reason for a `finished`, the error's code and details otherwise."""
    try:
        while True:
            event = await call.read()
            if event is grpc.aio.EOF:
                return grpc.StatusCode.OK, "EOF without finished", 0
            if event.HasField("finished"):  # type: ignore[attr-defined]  # grpc-stubs type read() as object (its EOF's type)
                return grpc.StatusCode.OK, event.finished.message, event.finished.finish_reason  # type: ignore[attr-defined]  # grpc-stubs type read() as object (its EOF's type)
    except grpc.aio.AioRpcError as err:
        return err.code(), err.details() or "", 0


async def health_status(svc: EngineService) -> int:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{svc.port}") as channel:
        req = health_pb2.HealthCheckRequest(service="kvmesh.v1.Engine")
        return (await health_pb2_grpc.HealthStub(channel).Check(req)).status


async def until_not_serving_reported(fake: FakeScheduler) -> None:
    while (await fake.next("load")).load.serving:
        pass


async def assert_failed_engine(svc: EngineService, stub: Stub, reason: str) -> None:
    """What a failed engine shows: health, new work refused, exit asked for."""
    assert await health_status(svc) == health_pb2.HealthCheckResponse.NOT_SERVING
    assert not svc.runtime.serving and svc.runtime.dead is not None
    assert reason in await asyncio.wait_for(svc.failure(), 1)
    code, details, _ = await ending(await _write(stub.Generate(), "after"))
    assert code == grpc.StatusCode.UNAVAILABLE and "engine failed" in details


async def _write(call: grpc.aio.StreamStreamCall, rid: str) -> grpc.aio.StreamStreamCall:
    await call.write(engine_pb2.EngineGenerateMessage(request=engine_pb2.EngineRequest(
        request_id=rid, prompt_token_ids=[1, 2], sampling=common_pb2.SamplingParams(max_tokens=2))))
    return call


@pytest.fixture
async def scheduler() -> AsyncIterator[tuple[FakeScheduler, int]]:
    server, fake, port = await start_fake()
    try:
        yield fake, port
    finally:
        await server.stop(0)


# ---------------------------------------------------------------- dead


async def test_a_crashed_backend_ends_every_stream_as_engine_loss(scheduler: tuple[FakeScheduler, int]) -> None:
    fake, port = scheduler
    svc = EngineService(mesh_config(), sim_engine(scheduler_address=f"127.0.0.1:{port}"))
    async with started(svc), engine_stub(svc) as stub:
        calls = [await open_stream(stub, f"r{i}") for i in range(3)]
        assert (await fake.next("load")).load.serving
        assert not svc.runtime.died.is_set()
        svc.backend.crash("test: the core process was killed")  # type: ignore[attr-defined]  # the sim backend's test hook
        ends = await asyncio.wait_for(asyncio.gather(*(ending(call) for call in calls)), 5)
        for code, details, _ in ends:
            assert code == grpc.StatusCode.UNAVAILABLE, details
            assert "engine failed" in details and "the core process was killed" in details
        await asyncio.wait_for(until_not_serving_reported(fake), 5)
        await assert_failed_engine(svc, stub, "the core process was killed")


async def test_a_backend_that_dies_idle_fails_the_engine_too() -> None:
    engine = sim_engine(hang_floor_seconds=0.2)  # the watch looks every 50 ms
    svc = EngineService(mesh_config(), engine)
    async with started(svc), engine_stub(svc) as stub:
        svc.backend.crash("test: died with nothing running")  # type: ignore[attr-defined]  # the sim backend's test hook
        await asyncio.wait_for(svc.runtime.died.wait(), 2)
        await assert_failed_engine(svc, stub, "died with nothing running")


async def test_a_failed_engine_stops_and_its_main_loop_raises_for_an_exit() -> None:
    svc = EngineService(mesh_config(), sim_engine())
    main = asyncio.create_task(run_until_signalled("engine", svc.start, svc.stop, freeze_heap=False,
                                                   failure=svc.failure))
    while not svc.runtime.serving:
        await asyncio.sleep(0.01)
    async with engine_stub(svc) as stub:
        call = await open_stream(stub, "live")
        svc.backend.crash("test: crash")  # type: ignore[attr-defined]  # the sim backend's test hook
        assert (await ending(call))[0] == grpc.StatusCode.UNAVAILABLE
    with pytest.raises(ServiceFailed, match="engine failed: backend dead: test: crash"):
        await asyncio.wait_for(main, 5)
    assert svc._server is None and not svc.runtime.started  # stopped before raising


class PoisonSim(SimBackend):
    """The sim, except that a request whose id starts with "poison" fails
    on its own after one token (a per-request bug, not the engine's)."""

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[GenerationOutput, None]:
        if not request.request_id.startswith("poison"):
            async for out in super().generate(request):
                yield out
            return
        yield GenerationOutput(token_ids=[7], text="x")
        raise RuntimeError("a bug in this request's sampling")


async def test_one_requests_failure_ends_only_that_request() -> None:
    engine = sim_engine()
    svc = EngineService(mesh_config(), engine, backend=PoisonSim(mesh_config(), engine))
    async with started(svc), engine_stub(svc) as stub:
        healthy = await open_stream(stub, "healthy", max_tokens=400)
        poison = await open_stream(stub, "poison-1")
        code, details, reason = await ending(poison)
        assert code == grpc.StatusCode.OK and reason == common_pb2.FINISH_REASON_ERROR
        assert "a bug in this request's sampling" in details
        code, _, reason = await ending(healthy)
        assert code == grpc.StatusCode.OK and reason == common_pb2.FINISH_REASON_LENGTH
        assert svc.runtime.serving and svc.runtime.dead is None and not svc.runtime.died.is_set()
        assert await health_status(svc) == health_pb2.HealthCheckResponse.SERVING


# ---------------------------------------------------------------- hung


async def test_a_hung_backend_is_detected_within_its_bound_and_fails_the_engine(
        scheduler: tuple[FakeScheduler, int]) -> None:
    fake, port = scheduler
    engine = sim_engine(scheduler_address=f"127.0.0.1:{port}", hang_floor_seconds=0.1, hang_step_multiple=20.0)
    engine.sim.speed_factor = 2.0  # ~16 ms a step: the bound is k x p99 step, above the floor
    svc = EngineService(mesh_config(), engine)
    async with started(svc), engine_stub(svc) as stub:
        calls = [await open_stream(stub, f"r{i}") for i in range(2)]
        await asyncio.sleep(0.5)  # some steps for the statistics
        detector = svc.runtime.liveness.detector
        svc.backend.hang()  # type: ignore[attr-defined]  # the sim backend's test hook
        hung_at = time.monotonic()
        bound = detector.bound()
        assert bound > engine.hang_floor_seconds  # derived from the step times, not the floor
        ends = await asyncio.wait_for(asyncio.gather(*(ending(call) for call in calls)), bound + 5)
        detected = time.monotonic() - hung_at
        for code, details, _ in ends:
            assert code == grpc.StatusCode.UNAVAILABLE and "backend hung" in details, details
        # The last output came at most one step before the hang; the watch
        # looks every `period`; a busy test machine adds scheduling delay.
        print(f"hang bound {bound:.3f} s, detected after {detected:.3f} s")
        assert bound - 0.1 <= detected <= bound + svc.runtime.liveness.period + 1.0, (detected, bound)
        await asyncio.wait_for(until_not_serving_reported(fake), 5)
        await assert_failed_engine(svc, stub, "backend hung")
        svc.backend.resume()  # type: ignore[attr-defined]  # the sim backend's test hook


async def test_an_idle_backend_is_hung_only_when_it_does_not_answer_its_probe() -> None:
    svc = EngineService(mesh_config(), sim_engine(hang_floor_seconds=0.1))
    async with started(svc), engine_stub(svc) as stub:
        await asyncio.sleep(0.4)  # four floors, idle and answering its probes
        assert svc.runtime.dead is None and svc.runtime.serving
        code, _, reason = await ending(await _write(stub.Generate(), "later"))
        assert code == grpc.StatusCode.OK and reason == common_pb2.FINISH_REASON_LENGTH
        svc.backend.hang()  # type: ignore[attr-defined]  # the sim backend's test hook
        await asyncio.wait_for(svc.runtime.died.wait(), 30)
        assert "no answer to a liveness probe" in (svc.runtime.dead or "")


def test_the_hang_bound_is_max_of_floor_and_k_times_p99_step() -> None:
    clock = FakeClock()
    detector = HangDetector(HangPolicy(floor_seconds=2.0, step_multiple=10.0), clock.monotonic())
    assert detector.bound() == 2.0  # no steps yet: the floor
    for _ in range(99):
        detector.output(clock.monotonic(), 0.05)
    assert detector.bound() == 2.0  # 10 x 50 ms is below the floor
    for _ in range(3):  # 3 of 102 slow steps: the p99 is one of them
        detector.output(clock.monotonic(), 0.4)
    assert detector.step_p99() == 0.4 and detector.bound() == pytest.approx(4.0)
    clock.advance(4.0)
    assert detector.hung(clock.monotonic()) is None  # exactly the bound: not yet
    clock.advance(0.01)
    assert "no output for 4.0 s" in (detector.hung(clock.monotonic()) or "")


def test_the_watch_on_a_fake_clock() -> None:
    clock = FakeClock()
    in_backend, dead, failures = [0], [None], list[str]()
    watch = LivenessWatch(HangPolicy(floor_seconds=1.0, step_multiple=10.0), clock, lambda: in_backend[0],
                          lambda: dead[0], failures.append)
    assert watch.period == 0.25
    clock.advance(100.0)
    assert watch.check() is None  # idle for 100 s: nothing owed
    in_backend[0] = 1
    watch.entered()
    clock.advance(0.9)
    previous = watch.output(None)  # first output: progress, no interval
    clock.advance(0.9)
    watch.output(previous)  # a 0.9 s step: bound max(1, 9) = 9 s
    clock.advance(9.0)
    assert watch.check() is None and failures == []
    clock.advance(0.5)
    assert "backend hung" in (watch.check() or "")
    assert len(failures) == 1 and watch.check() == failures[0]  # reported once


def test_a_dead_backend_is_acted_on_within_a_quarter_second_by_default() -> None:
    # vLLM's backend sees its processes die at once (process_watch.py); the watch must not sit on it.
    watch = LivenessWatch(HangPolicy(), FakeClock(), lambda: 0, lambda: None, lambda _: None)
    assert watch.period <= 0.25


async def test_a_failed_engine_stops_serving_before_any_stream_is_handed_over() -> None:
    """The scheduler learns first (runtime listeners: the link's load report),
    so the streams' replacements are not placed back on the failed engine."""
    svc = EngineService(mesh_config(), sim_engine())
    async with started(svc), engine_stub(svc) as stub:
        calls = [await open_stream(stub, f"r{i}") for i in range(3)]
        while svc.runtime.live_count < 3:
            await asyncio.sleep(0.01)
        generations = [svc.runtime.live(f"r{i}") for i in range(3)]
        seen: list[tuple[bool, list[bool]]] = []
        svc.runtime.add_listener(lambda: seen.append(
            (svc.runtime.serving, [g is not None and g.handed_over for g in generations])))
        svc.runtime.fail("test: the core died")
        assert seen[0] == (False, [False, False, False]), seen
        assert all(g is not None and g.handed_over for g in generations)
        for call in calls:
            code, _, _ = await asyncio.wait_for(ending(call), 5)
            assert code == grpc.StatusCode.UNAVAILABLE


def test_a_backend_that_says_it_is_dead_fails_at_the_next_check() -> None:
    dead: list[str | None] = [None]
    failures: list[str] = []
    watch = LivenessWatch(HangPolicy(), FakeClock(), lambda: 0, lambda: dead[0], failures.append)
    assert watch.check() is None
    dead[0] = "core process exited"
    assert watch.check() == "backend dead: core process exited" and failures == [watch.failure]


async def test_an_idle_backend_that_never_answers_its_probe_is_hung() -> None:
    # The gateways' stall deadlines move a wedged core's streams away within
    # seconds; the core then holds nothing and shows no progress: only the
    # probe finds it. A probe answered in time (or an idle, healthy backend) is no hang.
    clock = FakeClock()
    answer = asyncio.Event()
    sent: list[float] = []

    async def probe() -> None:
        sent.append(clock.monotonic())
        await answer.wait()

    failures: list[str] = []
    watch = LivenessWatch(HangPolicy(floor_seconds=10.0, step_multiple=10.0), clock, lambda: 0,
                          lambda: None, failures.append, probe)
    assert watch.check() is None
    await asyncio.sleep(0)
    assert len(sent) == 1
    answer.set()                                   # answered: healthy
    await asyncio.sleep(0)
    clock.advance(watch.probe_every)
    assert watch.check() is None
    await asyncio.sleep(0)
    assert len(sent) == 2                          # answered at once (the event stays set)
    # Each answer is progress (LoadReport.backend_progress); so is each output.
    assert watch.progress == 2
    watch.output(None)
    assert watch.progress == 3
    answer.clear()
    clock.advance(watch.probe_every)
    assert watch.check() is None                   # a third probe, now unanswered
    await asyncio.sleep(0)
    clock.advance(10.0)
    assert watch.check() is None                   # within the 10 s bound
    assert watch.progress == 3                     # a core that does not answer shows none
    clock.advance(0.5)
    assert "no answer to a liveness probe for 10.5 s" in (watch.check() or "")
    assert len(failures) == 1
    await watch.stop()
