"""Deadlines from live latency (services/scheduler/deadlines.py,
services/gateway/stall_watch.py) on a real mesh: scheduler, two sim engines,
gateway, Envoy.

1. The sim's speed changes at run time (POST /sim/speed, factor 1 -> 100): the
   token-stall deadline the scheduler derives follows the p95 gap between
   deltas (GetState and the metric agree).
2. engine-0 is SIGSTOPped mid-stream: alive on the network (keepalive is set
   far out) but producing nothing. Its streams move to engine-1 after about
   3 x p95 gap -- the stall watch, not keepalive (20 s), not the hang floor
   (60 s here, 30 s by default), not the 120 s generation limit -- and every
   client's text is exactly the uninterrupted one.
3. Requests queued past the derived queue-wait bound are rejected 503 with a
   message naming the bound and the p95 it came from.
"""

from __future__ import annotations

import itertools
import os
import signal
import time
import urllib.request

import pytest
from _streams import StreamResult, eventually, gateway_counter, run_streams, scheduler_state, set_sim_speed
from prometheus_client.parser import text_string_to_metric_families
from test_e2e_reliability import _assert_same, _finish, _prompts

from services.common.config import MeshConfig
from services.common.proto.kvmesh.v1 import scheduler_pb2
from services.launcher.mesh import Mesh

STREAMS = 8
TOKENS = 24          # 16 gaps sampled per stream: 8 streams refill the 64-sample window
# The run-time speed factor: a decode step of ~0.4 s instead of ~4 ms. Far
# above a loaded 2-core machine's own noise (p95 gaps of ~0.2 s at factor 1).
SLOW = 100.0
VICTIM = "engine-0"


def MESH_TUNE(config: MeshConfig) -> None:  # noqa: N802 - the fixture's hook name
    d = config.deadlines
    d.min_samples, d.window_samples, d.window_seconds = 10, 64, 120.0
    # Small floors, so the derived values show (the defaults are 5 s / 10 s / 20 s).
    d.token_stall.floor_seconds = 1.0
    # Not the first token's: a burst of prefills at factor 100 takes seconds,
    # and a first-token deadline under that would move healthy streams.
    d.first_token.floor_seconds = 10.0
    d.queue_wait.floor_seconds = 1.0
    # A class's queue-wait floor adds its aging time to P0 (P1: + 30 s by
    # default); aging in 0.1 s keeps the test's P1 floor at 1.1 s. Aged to
    # P0, the queued requests must still wait their turn: no P0-only lease
    # slots, no preemption of the running ones.
    config.scheduler.aging.p1_seconds = config.scheduler.aging.p2_seconds = 0.1
    config.scheduler.p0_reserved_leases = 0
    config.scheduler.preempt_classes = []
    config.engines.template.max_running = 8
    # Keepalive and the hang detector far out: only the stall watch can move
    # a stream off the stopped engine within seconds.
    config.network.keepalive_time_seconds = 10.0
    config.network.keepalive_timeout_seconds = 10.0
    config.engines.template.hang_floor_seconds = 60.0


def _deadline(mesh: Mesh, kind: str) -> scheduler_pb2.DeadlineState:
    """The `kind` deadline of the class the test's requests ran in (the one with samples)."""
    state = scheduler_state(mesh)
    assert state is not None
    found = [d for d in state.deadlines if d.kind == kind and d.model == mesh.config.engines.template.model]
    assert found, f"no {kind} deadline in GetState: {state.deadlines}"
    return max(found, key=lambda d: d.samples)


def _gauge(mesh: Mesh, name: str, kind: str, priority: int) -> float | None:
    with urllib.request.urlopen(f"http://127.0.0.1:{mesh.config.scheduler.metrics_port}/metrics", timeout=10) as r:
        text = r.read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels.get("kind") == kind \
                    and sample.labels.get("priority") == f"P{priority}":
                return float(sample.value)
    return None


async def _run(mesh: Mesh, prompts: list[str], tokens: int = TOKENS) -> list[StreamResult]:
    _, tasks, session = await run_streams(mesh, prompts, [tokens] * len(prompts))
    return await _finish(tasks, session)


async def _derived_stall(mesh: Mesh, label: str) -> scheduler_pb2.DeadlineState:
    """GetState's token_stall deadline, once the metric shows the same value."""
    d = _deadline(mesh, "token_stall")

    def metric_agrees() -> bool:
        value = _gauge(mesh, "kvmesh_scheduler_deadline_seconds", "token_stall", d.priority)
        return value is not None and abs(value - _deadline(mesh, "token_stall").deadline_seconds) < 1e-6
    await eventually(metric_agrees, 30, "the deadline gauge to match GetState")
    d = _deadline(mesh, "token_stall")
    p95 = _gauge(mesh, "kvmesh_scheduler_latency_p95_seconds", "token_stall", d.priority)
    print(f"[{label}] token_stall: p95 gap {d.p95_seconds * 1000:.1f} ms over {d.samples} samples -> "
          f"deadline {d.deadline_seconds:.3f} s ({d.source}); the gauges say p95 {p95} (as of the last tick)")
    return d


def _gap_after(result: StreamResult, stopped_at: float) -> float:
    """The longest silence the client saw from its last chunk before the stop on."""
    times = [t for t in result.chunk_at if t >= stopped_at]
    before = [t for t in result.chunk_at if t < stopped_at]
    points = ([before[-1]] if before else []) + times
    return max((b - a for a, b in itertools.pairwise(points)), default=0.0)


async def test_stall_deadline_follows_the_p95_and_a_stalled_stream_migrates(e2e_mesh: Mesh) -> None:
    mesh = e2e_mesh
    prompts = _prompts("deadline", STREAMS)
    set_sim_speed(mesh, 1.0)
    baseline = await _run(mesh, prompts)
    _assert_same(baseline, [r.text for r in baseline])
    expected = [r.text for r in baseline]
    fast = await _derived_stall(mesh, "factor 1")

    set_sim_speed(mesh, SLOW)
    try:
        _assert_same(await _run(mesh, prompts), expected)
        slow = await _derived_stall(mesh, f"factor {SLOW:g}")
        assert slow.p95_seconds > max(0.3, 1.5 * fast.p95_seconds), (fast, slow)
        assert slow.source == "derived" and slow.deadline_seconds == pytest.approx(3 * slow.p95_seconds, rel=1e-3)
        assert slow.deadline_seconds > fast.deadline_seconds

        stalls = gateway_counter(mesh, "kvmesh_gateway_engine_stalls_total")
        migrations = gateway_counter(mesh, "kvmesh_gateway_migrations_total")
        pid = mesh.pid(VICTIM)
        assert pid is not None
        results, tasks, session = await run_streams(mesh, prompts, [TOKENS] * STREAMS)
        try:
            await eventually(lambda: all(r.chunks >= 3 for r in results), 60, "every stream mid-answer")
            deadline = _deadline(mesh, "token_stall").deadline_seconds
            os.kill(pid, signal.SIGSTOP)
            stopped_at = time.monotonic()
            done = await _finish(tasks, session)
            gaps = sorted(_gap_after(r, stopped_at) for r in done)
        finally:
            os.kill(pid, signal.SIGCONT)
        _assert_same(done, expected)
        moved = gateway_counter(mesh, "kvmesh_gateway_migrations_total") - migrations
        stalled = gateway_counter(mesh, "kvmesh_gateway_engine_stalls_total") - stalls
        detect = mesh.config.network.detect_seconds
        print(f"{VICTIM} SIGSTOPped with {STREAMS} streams at factor {SLOW:g}: {stalled:.0f} stalls declared, "
              f"{moved:.0f} streams migrated, all exact; stall deadline {deadline:.3f} s "
              f"(3 x p95 {slow.p95_seconds * 1000:.0f} ms); longest client-side silence {gaps[-1]:.2f} s "
              f"(keepalive bound {detect:.0f} s, hang floor {mesh.config.engines.template.hang_floor_seconds:.0f} s, "
              f"generation limit {mesh.config.gateway.max_generation_seconds:.0f} s)")
        assert stalled >= 1 and moved >= stalled
        # It moved after about the deadline: not at once, and well before any fixed bound.
        assert 0.8 * deadline <= gaps[-1] < min(8.0, detect / 2), gaps
    finally:
        set_sim_speed(mesh, None)


async def test_queued_past_the_derived_bound_is_rejected_with_bound_and_p95(e2e_mesh: Mesh) -> None:
    mesh = e2e_mesh
    # Each stream holds its slot for seconds: 16 slots. 12 requests first, so
    # the windows hold slow gaps and waits of ~0 (the queue-wait bound is the
    # floor); then 24 at once.
    set_sim_speed(mesh, SLOW)
    try:
        assert all(r.ok for r in await _run(mesh, _prompts("warm", 12), 8))
        results = await _run(mesh, _prompts("queue", 24), 8)   # ~3 s each
    finally:
        set_sim_speed(mesh, None)
    rejected = [r for r in results if r.status == 503]
    assert rejected, ([(r.status, r.error) for r in results], _deadline(mesh, "queue_wait"))
    failed = [(r.status, r.finish_reason, r.error) for r in results if r.status != 503 and not r.ok]
    assert not failed, (failed, mesh.log_tail("gateway-0", 60))
    bound = _deadline(mesh, "queue_wait")
    print(f"queue_wait deadline {bound.deadline_seconds:.2f} s ({bound.source}, p95 "
          f"{bound.p95_seconds * 1000:.1f} ms over {bound.samples}); {len(rejected)} of 24 rejected: "
          f"{rejected[0].error}")
    for r in rejected:
        assert "queue-wait deadline" in (r.error or "") and "from the p95" in (r.error or ""), r.error
