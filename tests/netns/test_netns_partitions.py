"""Silent partitions on a real mesh of namespace hosts (scheduler, two sim
engines, two gateways, Envoy, a client: tests/netns/mesh.py). A cut host's
switch port goes down: no RST, no FIN, its peers only see silence, which
the mesh's keepalives must notice. The sim's text is a pure function of the
tokens before it (like greedy decoding), so every stream is compared with an
uninterrupted run of the same request: nothing repeated, nothing missing.

- An engine host cut with 20 streams in flight: 20/20 complete, identical;
  time from the cut to the first migrated token is measured. Healed, the
  engine holds no generation (none keeps running orphaned) and rejoins.
- A gateway host cut: Envoy's health checks drop it and new requests succeed
  through the other gateway; with resume (Last-Event-ID), the cut gateway's
  streams continue through the other one.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

import aiohttp
import pytest

from services.common.config import MeshConfig

from .client import Stream, expected_answers, run_on, run_streams, stream_completion, wait_until
from .mesh import ROOT, NetnsMesh, metric

pytestmark = pytest.mark.timeout(300)

STREAMS = 20
TOKENS = 160
# A stream whose next chunk came this long after the cut was on the cut
# engine (a healthy stream gets a chunk every ~0.1 s at this sim speed).
STALL_SECONDS = 2.0
# After the heal, the engine must hold no generation within this. What ends
# an orphan: the engine's end of the gateway's dead call (gRPC's TCP user
# timeout or keepalive), or, once a generation outlives its call (detached,
# waiting for a resume), fencing: the scheduler leases it elsewhere now.
ORPHAN_BOUND_SECONDS = 30.0
# A detached generation's grace (helper "resume"): it starts when the cut
# engine's end of the call breaks (seconds after the cut), and outlasts the
# heal (seconds after that) plus the orphan bound.
RESUME_GRACE_SECONDS = 45.0


def MESH_TUNE(config: MeshConfig) -> None:  # noqa: N802 - the fixture's hook name
    # ~12 tokens/s per stream: streams last long enough to be cut mid-answer.
    config.engines.template.sim.speed_factor = 8.0
    # A stalled stream is told from a quiet one within a few seconds.
    config.gateway.heartbeat_seconds = 1.0
    # Where this branch has them (helpers "fence" and "resume"): partitions
    # noticed within 2 + 2 s on every hop, and a detached generation kept
    # longer than the orphan bound after a heal, so that only fencing, not
    # the end of its grace, can end it within the bound.
    network = getattr(config, "network", None)
    if network is not None:
        network.keepalive_time_seconds = network.keepalive_timeout_seconds = 2.0
    resume = getattr(config, "resume", None)
    if resume is not None:
        resume.grace_seconds = RESUME_GRACE_SECONDS


def _resume_supported() -> bool:
    return any("last-event-id" in p.read_text().lower() for p in (ROOT / "services" / "gateway").glob("*.py"))


def _prompts(tag: str, n: int) -> list[str]:
    return [f"{tag} request {i}: tell me a long story about hosts and bridges." for i in range(n)]


def _assert_same(streams: list[Stream], expected: list[str]) -> None:
    failed = [(i, s.status, s.finish_reason, s.error) for i, s in enumerate(streams) if not s.ok]
    assert not failed, f"{len(failed)} streams did not complete: {failed[:5]}"
    for i, (s, want) in enumerate(zip(streams, expected, strict=True)):
        got = s.text
        assert got == want, (
            f"stream {i} differs from the uninterrupted run at char "
            f"{next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))}"
            f" (got {len(got)} chars, want {len(want)})")


def _migrations(mesh: NetnsMesh) -> float:
    return sum(mesh.gateway_counter(r, "kvmesh_gateway_migrations_total") for r in (0, 1))


@dataclasses.dataclass
class _CutRun:
    streams: list[Stream]
    victim: int       # the index of the engine whose host was cut
    cut_at: float
    healed_at: float
    live_at_cut: int
    live_at_heal: int
    # (seconds after the cut, generations the cut engine held), read on its own host.
    timeline: list[tuple[float, int]]


def _cut_engine_under_streams(mesh: NetnsMesh, prompts: list[str]) -> _CutRun:
    """Cut the host of the engine holding more streams (engine-0 on a tie)
    with every stream mid-answer; heal it as soon as every stream flows again
    (the cut ones moved elsewhere), so whatever it still holds then is
    orphaned; run the streams to their end. The busier engine, not always
    engine-0: the same prompts' reference run warmed one engine's prefix cache,
    and placement may rightly send every stream there."""
    streams = [Stream(p, TOKENS) for p in prompts]

    async def run() -> _CutRun:
        tasks, session = run_streams(mesh.public_http, streams)
        try:
            await wait_until(lambda: all(s.chunks >= 3 for s in streams), 60, "every stream to be mid-answer")
            assert not any(s.done for s in streams), "a stream ended before the cut: make them longer"
            held = [await asyncio.to_thread(mesh.engine_live, i) for i in (0, 1)]
            victim = 1 if held[1] > held[0] else 0
            live, host = held[victim], f"eng{victim}"
            cut_at = time.monotonic()
            await asyncio.to_thread(mesh.net.cut, host)
            timeline: list[tuple[float, int]] = []

            def flowing() -> bool:
                return all(s.done or s.chunk_times[-1] > cut_at + STALL_SECONDS for s in streams)
            healed_at, live_at_heal = 0.0, -1
            while not all(t.done() for t in tasks):
                now = time.monotonic()
                timeline.append((now - cut_at, await asyncio.to_thread(mesh.engine_live, victim)))
                if not healed_at and flowing():
                    live_at_heal = await asyncio.to_thread(mesh.engine_live, victim)
                    await asyncio.to_thread(mesh.net.heal, host)
                    healed_at = time.monotonic()
                assert now - cut_at < 120 or healed_at, "streams did not flow again within 120 s of the cut"
                await asyncio.wait(tasks, timeout=0.5)
            await asyncio.gather(*tasks)
            assert healed_at, "every stream ended before the cut engine's were moved"
            return _CutRun(streams, victim, cut_at, healed_at, live, live_at_heal, timeline)
        finally:
            await session.close()

    try:
        return run_on(mesh.client, run, timeout=200)
    finally:
        for host in ("eng0", "eng1"):  # whatever happened
            mesh.net.heal(host)


def test_engine_host_cut_streams_complete_identical_and_no_orphan_after_heal(netns_mesh: NetnsMesh) -> None:
    mesh = netns_mesh
    prompts = _prompts("cut", STREAMS)
    expected = expected_answers(mesh, prompts, TOKENS)
    migrations = _migrations(mesh)

    run = _cut_engine_under_streams(mesh, prompts)
    ended = time.monotonic()
    _assert_same(run.streams, expected)
    victim, name = run.victim, f"engine-{run.victim}"
    assert run.live_at_cut > 0, f"{name} held no stream when it was cut"
    # The streams on the cut engine stall, then flow again on the other one.
    resumed = [s.resumed_after_stall(run.cut_at, STALL_SECONDS) for s in run.streams]
    stalled = sorted(r - run.cut_at for r in resumed if r is not None)
    moved = _migrations(mesh) - migrations
    assert stalled and moved >= len(stalled), (stalled, moved)
    print(f"\nengine host cut: {STREAMS}/{STREAMS} streams complete and identical; {name} held "
          f"{run.live_at_cut}; {len(stalled)} stalled and migrated ({moved:.0f} migrations); cut -> first "
          f"migrated token {stalled[0]:.1f}s, -> last stalled stream resumed {stalled[-1]:.1f}s, -> last "
          f"token {ended - run.cut_at:.1f}s")
    heal = run.healed_at - run.cut_at
    changes = [(t, n) for k, (t, n) in enumerate(run.timeline) if k == 0 or run.timeline[k - 1][1] != n]
    print(f"  {name}'s generations, read on its host (s after the cut: held): "
          + ", ".join(f"{t:.1f}:{n}" for t, n in changes) + f"; healed at {heal:.1f}")

    # Healed: nothing orphaned keeps running there, and it serves again.
    mesh.wait_for(lambda: mesh.engine_live(victim) == 0,
                  max(1.0, run.healed_at + ORPHAN_BOUND_SECONDS - time.monotonic()),
                  f"{name} to hold no generation within {ORPHAN_BOUND_SECONDS} s of the heal")
    samples = [*run.timeline, (time.monotonic() - run.cut_at, 0)]
    zero_after_heal = next(t for t, n in samples if t >= heal and n == 0) - heal
    tokens = metric(mesh.engine_metrics(victim), "vllm:generation_tokens_total")
    time.sleep(1.0)
    assert metric(mesh.engine_metrics(victim), "vllm:generation_tokens_total") == tokens, f"{name} still generates"
    mesh.wait_for(lambda: mesh.fresh_engines() == 2, 60, f"{name} to rejoin the scheduler")
    assert mesh.exited() == {}, f"services exited: {mesh.exited()}"
    fenced = metric(mesh.engine_metrics(victim), "kvmesh_engine_fenced_total")  # helper "fence"'s counter, if any
    print(f"  healed with {run.live_at_heal} generations still on {name}; it held none "
          f"{zero_after_heal:.1f}s after the heal (bound {ORPHAN_BOUND_SECONDS:.0f}s; {fenced:.0f} fenced); "
          f"rejoined the scheduler")


def test_gateway_host_cut_new_requests_succeed_through_envoy(netns_mesh: NetnsMesh) -> None:
    mesh = netns_mesh
    long_streams = [Stream(p, TOKENS) for p in _prompts("held", 6)]
    new_streams = [Stream(p, 16) for p in _prompts("new", 10)]

    async def run() -> tuple[float, float]:
        tasks, session = run_streams(mesh.public_http, long_streams)
        try:
            await wait_until(lambda: all(s.chunks >= 1 for s in long_streams), 60, "long streams to run")
            active = await asyncio.to_thread(mesh.gateway_counter, 0, "kvmesh_gateway_active_streams")
            assert active > 0, "gateway-0 holds no stream"
            cut_at = time.monotonic()
            await asyncio.to_thread(mesh.net.cut, "gw0")
            dropped = await asyncio.to_thread(
                mesh.wait_for, lambda: mesh.envoy_dropped("gw0"), 30, "Envoy to drop gateway-0")
            new_tasks, new_session = run_streams(mesh.public_http, new_streams, timeout=30.0)
            try:
                await asyncio.gather(*new_tasks)
            finally:
                await new_session.close()
            return dropped, time.monotonic() - cut_at
        finally:
            for t in tasks:
                t.cancel()  # gateway-0's streams stall; resuming them is the next test's
            await asyncio.gather(*tasks, return_exceptions=True)
            await session.close()

    try:
        dropped, elapsed = run_on(mesh.client, run, timeout=120)
    finally:
        mesh.net.heal("gw0")
    bad = [(s.status, s.error) for s in new_streams if not s.ok]
    assert not bad, f"{len(bad)} new requests failed after gateway-0 was cut: {bad[:3]}"
    back = mesh.wait_for(lambda: mesh.envoy_healthy("gw0"), 60, "Envoy to take gateway-0 back")
    print(f"\ngateway host cut: Envoy dropped gateway-0 {dropped:.1f}s after the cut; "
          f"{len(new_streams)}/{len(new_streams)} new requests succeeded ({elapsed:.1f}s after the cut); "
          f"healed, back in rotation after {back:.1f}s")


# The window before Envoy's health checks drop a cut gateway: a request Envoy
# sends there on a pooled HTTP/1.1 connection (not a new one: a connect would
# time out and be retried on the other gateway) gets no answer, and its bytes
# stay unacknowledged, so TCP keepalive never probes; nothing but Envoy's
# stream idle timeout (300 s) ends it.
WINDOW_BOUND_SECONDS = 30.0


def test_gateway_host_cut_requests_sent_before_envoy_drops_it_end_within_bound(netns_mesh: NetnsMesh) -> None:
    mesh = netns_mesh
    warm = [Stream(p, 8) for p in _prompts("warm", 10)]
    window = [Stream(p, 8) for p in _prompts("window", 12)]

    async def run() -> list[float]:
        # Pooled upstream connections to both gateways, as under steady traffic.
        tasks, session = run_streams(mesh.public_http, warm)
        await asyncio.gather(*tasks)
        await session.close()
        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        took: list[float] = []

        async def one(s: Stream) -> None:
            start = time.monotonic()
            try:
                async with asyncio.timeout(WINDOW_BOUND_SECONDS):
                    await stream_completion(session, mesh.public_http, s)
            except TimeoutError:
                s.error = f"no answer within {WINDOW_BOUND_SECONDS} s"
            took.append(time.monotonic() - start)
        try:
            await asyncio.to_thread(mesh.net.cut, "gw0")
            sent = []
            for s in window:  # one every 0.25 s from the cut on: before and after Envoy drops gateway-0
                sent.append(asyncio.create_task(one(s)))
                await asyncio.sleep(0.25)
            await asyncio.gather(*sent)
            return took
        finally:
            await session.close()

    try:
        took = run_on(mesh.client, run, timeout=WINDOW_BOUND_SECONDS + 30)
    finally:
        mesh.net.heal("gw0")
    mesh.wait_for(lambda: mesh.envoy_healthy("gw0"), 60, "Envoy to take gateway-0 back")
    hung = [(i, s.error) for i, s in enumerate(window) if s.error and "no answer" in s.error]
    print(f"\nrequests sent in the first 3 s of a gateway cut: {sum(s.ok for s in window)}/{len(window)} ok, "
          f"{len(hung)} without an answer after {WINDOW_BOUND_SECONDS:.0f}s; slowest answered in "
          f"{max((t for t in took if t < WINDOW_BOUND_SECONDS), default=0):.1f}s")
    # A request Envoy wrote to the cut gateway's pooled connection is reset when
    # its health checks fail (close_connections_on_host_health_failure) and
    # retried on the other gateway: nothing hangs, nothing is refused.
    assert not hung, f"requests sent to the cut gateway hang: {hung}"
    failed = [(i, s.error) for i, s in enumerate(window) if not s.ok]
    assert not failed, f"requests sent during the cut failed: {failed}"


@pytest.mark.skipif(not _resume_supported(), reason="needs resume")
def test_gateway_host_cut_streams_resume_through_the_other_gateway(netns_mesh: NetnsMesh) -> None:
    mesh = netns_mesh
    n = 10
    prompts = _prompts("resume", n)
    expected = expected_answers(mesh, prompts, TOKENS)
    streams = [Stream(p, TOKENS) for p in prompts]

    async def run() -> float:
        # A stream silent for 4 heartbeats is stalled: the client resumes it.
        tasks, session = run_streams(mesh.public_http, streams, resume=True, stall_seconds=4.0)
        try:
            await wait_until(lambda: all(s.chunks >= 3 for s in streams), 60, "every stream to be mid-answer")
            active = await asyncio.to_thread(mesh.gateway_counter, 0, "kvmesh_gateway_active_streams")
            assert active > 0, "gateway-0 holds no stream"
            cut_at = time.monotonic()
            await asyncio.to_thread(mesh.net.cut, "gw0")
            await asyncio.gather(*tasks)
            return time.monotonic() - cut_at
        finally:
            await session.close()

    try:
        elapsed = run_on(mesh.client, run, timeout=200)
    finally:
        mesh.net.heal("gw0")
    _assert_same(streams, expected)
    resumed = sum(s.resumes > 0 for s in streams)
    assert resumed >= 1, "no stream was resumed: did gateway-0 hold none?"
    mesh.wait_for(lambda: mesh.envoy_healthy("gw0"), 60, "Envoy to take gateway-0 back")
    print(f"\ngateway host cut with resume: {n}/{n} streams complete and identical, {resumed} resumed "
          f"through gateway-1 (Last-Event-ID); {elapsed:.1f}s cut -> last token")
