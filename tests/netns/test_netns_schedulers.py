"""A scheduler replica's host cut off silently, on a real mesh of namespace
hosts with two active schedulers (README "Several schedulers"; the mesh of
tests/netns/mesh.py, plus a host for the second replica). The cut host's
switch port goes down: no reset, no FIN, the gateways' connections to it stay
open. Streams running when it is cut complete identical to an uninterrupted
run (their leases re-attach on the other replica), and requests sent after
the cut -- half of them owned by the cut replica, by rendezvous -- are all
answered, none refused: the gateways see the replica silent on their
AdmitMany calls (`network.silent_peer_seconds`) and move its requests before
keepalive (`network.detect_seconds`) would have. Healed, it gets its engines
back."""

from __future__ import annotations

import asyncio
import time

import pytest

from services.common.config import MeshConfig

from .client import Stream, expected_answers, run_on, run_streams, wait_until
from .mesh import ENGINES, SCHEDULER_HOSTS, NetnsMesh

pytestmark = pytest.mark.timeout(300)

TOKENS = 120
NEW_REQUESTS = 16
MESH_SCHEDULERS = 2   # the netns_mesh fixture's: a second replica on a host of its own


def MESH_TUNE(config: MeshConfig) -> None:  # noqa: N802 - the fixture's hook name
    # ~12 tokens/s per stream: streams last long enough to run across the cut.
    config.engines.template.sim.speed_factor = 8.0
    config.gateway.heartbeat_seconds = 1.0


def _prompts(tag: str, n: int) -> list[str]:
    return [f"{tag} request {i}: tell me a long story about replicas and links." for i in range(n)]


def _silences(mesh: NetnsMesh) -> int:
    return sum(mesh.log_tail(f"gateway-{r}", 10_000).count("presuming the peer gone") for r in (0, 1))


def test_a_cut_scheduler_host_loses_and_refuses_nothing(netns_mesh: NetnsMesh) -> None:
    mesh = netns_mesh
    running_prompts, new_prompts = _prompts("running", 8), _prompts("new", NEW_REQUESTS)
    expected = expected_answers(mesh, running_prompts + new_prompts, TOKENS)
    running = [Stream(p, TOKENS) for p in running_prompts]
    new = [Stream(p, TOKENS) for p in new_prompts]
    silences_before = _silences(mesh)

    async def run() -> float:
        tasks, session = run_streams(mesh.public_http, running)
        try:
            await wait_until(lambda: all(s.chunks >= 2 for s in running), 60, "every stream to be mid-answer")
            cut_at = time.monotonic()
            await asyncio.to_thread(mesh.net.cut, SCHEDULER_HOSTS[1])
            new_tasks, new_session = run_streams(mesh.public_http, new)
            try:
                await asyncio.gather(*tasks, *new_tasks)
            finally:
                await new_session.close()
            return cut_at
        finally:
            await session.close()

    try:
        cut_at = run_on(mesh.client, run, timeout=200)
    finally:
        mesh.net.heal(SCHEDULER_HOSTS[1])
    failed = [(i, s.status, s.finish_reason, s.error) for i, s in enumerate(running + new) if not s.ok]
    assert not failed, f"{len(failed)} requests were lost or refused with a scheduler host cut: {failed[:5]}"
    for i, (s, want) in enumerate(zip(running + new, expected, strict=True)):
        assert s.text == want, f"request {i} differs from the uninterrupted run"
    firsts = sorted((s.first_text_at or cut_at) - cut_at for s in new)
    silences = _silences(mesh) - silences_before
    # Half the new requests rank the cut replica first: they moved because the
    # gateways saw it silent, not because keepalive closed the connection.
    assert silences >= 1, "no gateway declared the cut scheduler silent"
    back = mesh.wait_for(lambda: mesh.fresh_engines(SCHEDULER_HOSTS[1]) == len(ENGINES), 60,
                         "both engines to report to the healed scheduler")
    print(f"\nscheduler host cut: {len(running)} running streams identical, {len(new)}/{len(new)} new requests "
          f"answered (first text {firsts[0]:.1f}-{firsts[-1]:.1f} s after the cut; keepalive bound "
          f"{mesh.config.network.detect_seconds:g} s), {silences} silence(s) declared; healed, its engines back "
          f"after {back:.1f} s")
