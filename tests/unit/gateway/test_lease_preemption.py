"""`LeaseLink` and preemption, step by step, over a scripted Admit session:
which `Preempted` stops the engine, which is ignored, what answers it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

from services.common.clock import FakeClock
from services.common.openai_api.requests import SamplingOptions
from services.common.prefix_hash import block_hashes
from services.common.proto.kvmesh.v1 import scheduler_pb2
from services.gateway.events import Finished, FinishReason, QueuedUpdate, TextDelta, Usage
from services.gateway.jobs import Job
from services.gateway.lease_link import LeaseLink
from services.gateway.metrics import GatewayMetrics
from services.gateway.scheduler_client import AdmitSession
from services.gateway.scheduler_replicas import SchedulerReplicas

PROMPT = list(range(100, 140))
PLACED = scheduler_pb2.Placed(engine_id="engine-b", engine_address="b:1", lease_id="l2")


class ScriptedSession:
    """What `LeaseLink` uses of an `AdmitSession`: records what it sends and
    answers `next_outcome` from a script."""

    def __init__(self, outcomes: list[scheduler_pb2.Queued | scheduler_pb2.Placed]) -> None:
        self.outcomes = outcomes
        self.sent: list[tuple[str, dict[str, Any]]] = []
        self.on_preempted: Callable[[scheduler_pb2.Preempted], None] | None = None

    def listen(self, on_preempted: Callable[[scheduler_pb2.Preempted], None]) -> None:
        self.on_preempted = on_preempted

    def on_broken(self, callback: Callable[[], None]) -> None:
        pass

    def preempt(self) -> None:
        assert self.on_preempted is not None
        self.on_preempted(scheduler_pb2.Preempted(engine_id="engine-a", preemptions=1, by_priority=0))

    async def next_outcome(self) -> scheduler_pb2.Queued | scheduler_pb2.Placed:
        return self.outcomes.pop(0)

    async def requeue(self, **kw: Any) -> None:
        self.sent.append(("requeue", kw))

    async def replace(self, **kw: Any) -> None:
        self.sent.append(("replace", kw))

    async def first_token(self) -> None:
        self.sent.append(("first_token", {}))

    async def report_done(self, done: scheduler_pb2.RequestDone) -> None:
        self.sent.append(("done", {}))

    def cancel(self) -> None:
        pass


def _lease(session: ScriptedSession, generated: list[int]) -> tuple[LeaseLink, GatewayMetrics]:
    clock = FakeClock()
    job = Job(
        request_id="r1", route="chat", model="m", tenant="t", priority=2, prompt_ids=PROMPT,
        prefix_hashes=block_hashes(PROMPT, 16), sampling=SamplingOptions(), max_tokens=50,
        max_generation_seconds=60, arrival_unix=clock.wall(), arrival_monotonic=clock.monotonic(),
        hash_block_tokens=16,
    )
    metrics = GatewayMetrics()
    lease = LeaseLink(cast(AdmitSession, session), job, generated, cast(SchedulerReplicas, None), metrics, clock)
    return lease, metrics


class Emitted(list[object]):
    async def __call__(self, event: QueuedUpdate | TextDelta | Finished) -> None:
        self.append(event)


async def test_preempted_while_running_stops_once_and_requeues_prompt_plus_generated() -> None:
    session = ScriptedSession([scheduler_pb2.Queued(position=2), PLACED])
    generated = [7, 8, 9]
    lease, metrics = _lease(session, generated)
    stops: list[str] = []
    lease.running_on("engine-a", lambda: stops.append("a"))
    session.preempt()
    session.preempt()  # a second one before the requeue changes nothing
    assert stops == ["a"]
    emitted = Emitted()
    assert await lease.requeue(emitted) == PLACED
    assert emitted == []  # tokens were sent: no queue positions to the client
    tokens = PROMPT + generated
    assert session.sent == [("requeue", {
        "prompt_tokens": len(tokens), "max_tokens": 47, "prefix_hashes": block_hashes(tokens, 16)})]
    assert 'kvmesh_gateway_preemptions_total{priority="P2"} 1.0' in metrics.render().decode()


async def test_preempted_when_not_running_is_ignored() -> None:
    session = ScriptedSession([PLACED])
    lease, _ = _lease(session, [])
    stops: list[str] = []
    lease.running_on("engine-a", lambda: stops.append("a"))
    await lease.report_done(Finished(FinishReason.STOP, Usage(40, 3, 0)))
    session.preempt()  # crossed `done`
    assert stops == []


async def test_preempted_between_placed_and_the_start_stops_the_new_engine_at_once() -> None:
    """After a requeue the stream is read ahead: the scheduler may place the
    request and take the new lease back before the driver starts on that
    engine. That `Preempted` is about the new lease: it must not be dropped
    (the request would run without a lease while the scheduler waits for its
    `Requeue`), but stop the new engine stream as soon as it starts."""
    session = ScriptedSession([PLACED, PLACED])
    lease, _ = _lease(session, [7])
    stops: list[str] = []
    lease.running_on("engine-a", lambda: stops.append("a"))
    session.preempt()
    assert await lease.requeue(Emitted()) == PLACED  # placed again ...
    session.preempt()  # ... and preempted again before the driver started there
    assert stops == ["a"]
    lease.running_on("engine-b", lambda: stops.append("b"))
    assert stops == ["a", "b"]
    assert await lease.requeue(Emitted()) == PLACED
    assert [kind for kind, _ in session.sent] == ["requeue", "requeue"]


async def test_preempted_crossing_an_engine_failure_is_answered_with_requeue() -> None:
    """The engine failed and, before the gateway said `replace`, the
    scheduler preempted the request: it waits for `Requeue`, not `Replace`."""
    session = ScriptedSession([PLACED])
    lease, _ = _lease(session, [5])
    lease.running_on("engine-a", lambda: None)
    session.preempt()
    assert await lease.replace(["engine-a"], Emitted()) == PLACED
    assert [kind for kind, _ in session.sent] == ["requeue"]


async def test_queue_positions_reach_the_client_only_before_the_first_token() -> None:
    session = ScriptedSession([scheduler_pb2.Queued(position=4), PLACED])
    lease, _ = _lease(session, [])
    lease.running_on("engine-a", lambda: None)
    session.preempt()
    emitted = Emitted()
    await lease.requeue(emitted)
    assert emitted == [QueuedUpdate(4, 0.0, 0)]
