"""Issue 29: `kvmesh up` restarts a dead gateway like the other services.
Two gateways behind Envoy, the supervision loop `kvmesh up` runs
(`up.supervise`); gateway-1 is SIGKILLed (a crash the launcher did not ask
for). It comes back on its ports, serves a request sent to it directly, and
Envoy takes it back: requests through Envoy are answered after."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import urllib.request

import aiohttp
from _streams import stream_completion, wait_until

from services.launcher.mesh import Mesh
from services.launcher.rolling import envoy_healthy
from services.launcher.up import supervise

MESH_GATEWAYS = 2


async def _direct(session: aiohttp.ClientSession, mesh: Mesh, replica: int) -> tuple[int, str]:
    body = {"model": mesh.config.engines.template.model, "prompt": "after the restart", "max_tokens": 8,
            "temperature": 0}
    async with session.post(f"{mesh.endpoints.gateway_http[replica]}/v1/completions", json=body,
                            headers={"Authorization": f"Bearer {mesh.api_key}"}) as resp:
        return resp.status, await resp.text()


def _healthy(mesh: Mesh, replica: int) -> bool:
    try:
        with urllib.request.urlopen(f"{mesh.endpoints.gateway_http[replica]}/health", timeout=2.0) as resp:
            return resp.status == 200
    except OSError:
        return False


async def test_a_sigkilled_gateway_is_restarted_and_serves(e2e_mesh: Mesh) -> None:
    mesh = e2e_mesh
    stop = threading.Event()
    watcher = threading.Thread(target=supervise, args=(mesh, stop), daemon=True)
    watcher.start()
    try:
        old = mesh.pid("gateway-1")
        assert old is not None
        os.kill(old, signal.SIGKILL)
        async with aiohttp.ClientSession() as session:
            await wait_until(lambda: mesh.pid("gateway-1") not in (None, old) and mesh.is_running("gateway-1"),
                             60, "gateway-1 to be started again")
            await wait_until(lambda: _healthy(mesh, 1), 60, "the new gateway-1 to be healthy")
            ends = mesh.endpoints
            await wait_until(lambda: envoy_healthy(ends.admin_port, ends.gateway_http[1].split("://", 1)[1],
                                                   ends.gateway_grpc[1]), 60, "Envoy to route to gateway-1 again")
            status, text = await _direct(session, mesh, 1)
            assert status == 200, text
            after = await asyncio.gather(*(stream_completion(session, mesh, f"after {i}", 16) for i in range(4)))
            assert all(r.ok for r in after), [r for r in after if not r.ok]
        log = (mesh.log_dir / "gateway-1.log").read_text(errors="replace")
        assert log.count("==== kvmesh: starting gateway-1") == 2   # started once more, not twice
    finally:
        stop.set()
        watcher.join(10)
