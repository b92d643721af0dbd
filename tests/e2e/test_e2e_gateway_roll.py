"""A rolling restart of both gateways under continuous load through Envoy:
nothing lost, nothing refused. Each gateway in turn gets SIGTERM, drains
(not ready -> Envoy takes it out; streams it holds finish; requests Envoy
still sends it are served), exits, comes back and is in rotation again
before the next one stops (`Mesh.rolling_restart`). Clients keep starting
new streams the whole time. Every answer must equal an uninterrupted run of
the same request (the sim's text is a pure function of the tokens before it,
like greedy decoding)."""

from __future__ import annotations

import asyncio
import itertools

import aiohttp
from _streams import StreamResult, sim_unthrottled, stream_completion, wait_until

from services.common.config import MeshConfig
from services.launcher.mesh import Mesh

MESH_GATEWAYS = 2
CLIENTS = 8
# Short and medium answers, and long ones (~8 s at the test sim's speed:
# longer than the fixed 5 s stop grace gateways had before they drained).
JOBS = [(f"roll request {i}: tell me about meshes, engines and queues.", 16 + 24 * (i % 5)) for i in range(10)]
JOBS += [(f"roll long request {i}: tell me a long story about meshes.", 1600) for i in range(2)]


def MESH_TUNE(config: MeshConfig) -> None:  # noqa: N802 - the fixture's hook name
    # Every stream finishes within the drain bound however slow the machine.
    config.gateway.drain_seconds = 300.0


async def _baseline(mesh: Mesh, session: aiohttp.ClientSession) -> dict[int, str]:
    """Each job's uninterrupted text (the sim unthrottled: only the text counts)."""
    with sim_unthrottled(mesh):
        results = await asyncio.gather(*(stream_completion(session, mesh, p, n) for p, n in JOBS))
    bad = [r for r in results if not r.ok]
    assert not bad, f"baseline run failed: {bad[0]}"
    return {i: r.text for i, r in enumerate(results)}


async def test_rolling_restart_of_both_gateways_under_load_loses_nothing(e2e_mesh: Mesh) -> None:
    mesh = e2e_mesh
    old_pids = {name: mesh.pid(name) for name in ("gateway-0", "gateway-1")}
    done: list[tuple[int, StreamResult, bool]] = []  # (job, result, started while rolling)
    rolling = asyncio.Event()
    rolled = asyncio.Event()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        expected = await _baseline(mesh, session)
        jobs = itertools.cycle(range(len(JOBS)))

        async def client() -> None:
            while not rolled.is_set():
                job = next(jobs)
                during = rolling.is_set()
                result = await stream_completion(session, mesh, *JOBS[job])
                done.append((job, result, during))

        clients = [asyncio.create_task(client()) for _ in range(CLIENTS)]
        await wait_until(lambda: len(done) >= CLIENTS, 120, "the load to be running")
        rolling.set()
        try:
            steps = await asyncio.to_thread(mesh.rolling_restart)
        finally:
            rolled.set()
        await asyncio.gather(*clients)

    assert [s.name for s in steps] == ["gateway-0", "gateway-1"]
    assert all(s.exit_code == 0 for s in steps), f"a gateway did not exit cleanly after its drain: {steps}"
    assert all(mesh.pid(n) != pid for n, pid in old_pids.items()), "a gateway was not restarted"
    failed = [(j, r.status, r.finish_reason, r.error) for j, r, _ in done if not r.ok]
    assert not failed, f"{len(failed)} of {len(done)} streams failed or were refused: {failed[:5]}"
    wrong = [j for j, r, _ in done if r.text != expected[j]]
    assert not wrong, f"{len(wrong)} streams differ from the uninterrupted run (jobs {wrong[:5]})"
    during = sum(1 for *_, d in done if d)
    assert during >= CLIENTS, f"only {during} requests started while the gateways rolled"
    drains = []
    for name in old_pids:
        log = (mesh.log_dir / f"{name}.log").read_text(errors="replace")
        assert "still in flight" not in log, f"{name} cut streams at its drain bound"
        drains += [line.split("drain: done, ", 1)[1] for line in log.splitlines() if "drain: done, " in line]
    assert len(drains) == 2, f"not every gateway finished a drain: {drains}"
    longs = sum(1 for j, *_ in done if JOBS[j][1] == 1600)
    print(f"rolled {[(s.name, round(s.seconds, 1)) for s in steps]}: {len(done)} streams ({longs} long), "
          f"{during} started while rolling, all complete and identical; drains: {drains}")
