"""A gateway's drain bound, with real processes behind Envoy: a stream that
outlives `gateway.drain_seconds` after SIGTERM is cut -- the gateway logs and
counts it, ends its process at once (exit 0, no polite cancel to the
engine: the generation is left to detach there for a resuming client) --
while Envoy sends new requests to the other gateway."""

from __future__ import annotations

import asyncio

import aiohttp
from _streams import StreamResult, gateway_counter, stream_completion, wait_until

from services.common.config import MeshConfig
from services.launcher.mesh import Mesh

MESH_GATEWAYS = 2
# 40 ms of simulated time per token: 1,600 tokens take over a minute on any
# machine (a slower one only makes it longer), far past the 4 s drain bound.
LONG_TOKENS = 1600


def MESH_TUNE(config: MeshConfig) -> None:  # noqa: N802 - the fixture's hook name
    config.engines.template.sim.speed_factor = 5.0
    config.gateway.drain_unready_seconds = 3.0  # the edge's removal bound (1 s x 2 + 1 s)
    config.gateway.drain_seconds = 4.0


async def test_stream_outliving_the_drain_bound_is_cut_and_the_gateway_exits(e2e_mesh: Mesh) -> None:
    mesh = e2e_mesh
    async with aiohttp.ClientSession() as session:
        long = StreamResult()
        task = asyncio.create_task(stream_completion(session, mesh, "drain cut: a very long story", LONG_TOKENS,
                                                     long))
        await asyncio.wait_for(long.first_chunk.wait(), 120)
        holder = next(r for r in range(MESH_GATEWAYS)
                      if gateway_counter(mesh, "kvmesh_gateway_active_streams", replica=r) == 1)
        name = f"gateway-{holder}"
        mesh.terminate(name)
        code = await asyncio.to_thread(mesh.wait, name, 120)
        result = await asyncio.wait_for(task, 60)
        assert code == 0, f"{name} did not exit by itself at its drain bound (code {code})"
        assert not result.done and result.finish_reason is None, "the long stream was not cut"
        log = (mesh.log_dir / f"{name}.log").read_text(errors="replace")
        assert "drain: 1 request(s) still in flight" in log, log[-2000:]
        # Meanwhile and afterwards Envoy answers from the other gateway.
        after = await stream_completion(session, mesh, "drain cut: a short one", 8)
        assert after.ok, after.error
    await asyncio.to_thread(mesh.restart, name)
    await wait_until(lambda: mesh.is_running(name), 30, f"{name} to run again")
