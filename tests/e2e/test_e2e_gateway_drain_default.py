"""A rolling update is invisible to a plain client (issue 29): SIGTERM of one
of two gateways under 12 long streams read by clients that never resume (no
Last-Event-ID, like the OpenAI SDK) -- 12/12 complete.

The drain bound is left at its default (`gateway.drain_seconds` unset), which
follows the mesh's generation bound: `max_generation_seconds` (90 s here, to
keep the test short) + `drain_unready_seconds`. The streams outlast the old
fixed 30 s bound, so the drain this test measures (> 30 s) would have cut
them before."""

from __future__ import annotations

import asyncio
import re

import aiohttp
from _streams import StreamResult, gateway_counter, stream_completion, wait_until

from services.common.config import MeshConfig
from services.launcher.mesh import Mesh

MESH_GATEWAYS = 2


def MESH_TUNE(config: MeshConfig) -> None:  # noqa: N802 - the fixture's hook name
    config.engines.template.sim.speed_factor = 6.0
    config.gateway.max_generation_seconds = 90.0
    config.gateway.drain_seconds = None  # the default: the generation bound


STREAMS, OLD_DRAIN_SECONDS = 12, 30.0
# ~9.5 ms of simulated work per step with 6 sequences per engine, x 6 =
# ~57 ms per token: 700 tokens run ~40 s, past the old 30 s drain bound and
# well inside the 90 s generation bound.
TOKENS = 700


async def test_sigterm_under_long_plain_streams_cuts_none(e2e_mesh: Mesh) -> None:
    mesh = e2e_mesh
    assert mesh.config.gateway.drain_bound_seconds == 93.0
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        results = [StreamResult() for _ in range(STREAMS)]
        tasks = [asyncio.create_task(stream_completion(session, mesh, f"drain default {i}: a long story", TOKENS, r))
                 for i, r in enumerate(results)]
        await asyncio.wait_for(asyncio.gather(*(r.first_chunk.wait() for r in results)), 120)
        held = {r: gateway_counter(mesh, "kvmesh_gateway_active_streams", replica=r) for r in range(MESH_GATEWAYS)}
        holder = max(held, key=lambda r: held[r])
        assert held[holder] >= 1, held
        name = f"gateway-{holder}"
        mesh.terminate(name)
        code = await asyncio.to_thread(mesh.wait, name, 150)
        done = await asyncio.wait_for(asyncio.gather(*tasks), 120)

    assert code == 0, f"{name} did not exit by itself after its drain (code {code})"
    broken = [(i, r.status, r.finish_reason, r.error, r.done) for i, r in enumerate(done) if not r.ok]
    assert not broken, f"{len(broken)}/{STREAMS} plain streams broke in the drain: {broken[:4]}"
    assert all(r.finish_reason == "length" for r in done)
    log = (mesh.log_dir / f"{name}.log").read_text(errors="replace")
    assert "still in flight" not in log, f"{name} cut streams at its drain bound"
    match = re.search(r"drain: done, nothing in flight after ([0-9.]+) s", log)
    assert match is not None, log[-2000:]
    assert float(match.group(1)) > OLD_DRAIN_SECONDS, (
        f"the drain took {match.group(1)} s: the streams did not outlast the old {OLD_DRAIN_SECONDS:g} s bound, "
        f"so this run shows nothing (held: {held})")
    await asyncio.to_thread(mesh.restart, name)
    await wait_until(lambda: mesh.is_running(name), 30, f"{name} to run again")
