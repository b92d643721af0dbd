"""Warm-spare promotion against a cold start, on vLLM-CPU (issue 28).

Starts a mesh of 2 vLLM engines (tiny-llama by default) with
`scheduler.spares.count: 1`, so one engine serves and one is a warm spare.

* Promotion, `--trials` times: a burst of P0 requests 3x the serving engine's
  lease slots queues P0 work that would miss its target; the scheduler
  promotes the spare. Read from the scheduler's own histograms (deltas per
  trial): decision -> first placement on it (kvmesh_scheduler_spare_promotion_seconds)
  and decision -> first token of a request placed on it
  (kvmesh_scheduler_spare_first_token_seconds). Then the burst ends, the
  model is calm for the hold and the engine returns to spare.
* Cold start, `--trials` times: the spare's process is stopped, then started
  again (`kvmesh engine`: import vLLM, load the model, warm up, connect);
  timed from the spawn to the scheduler listing it fresh and serving
  (GetState), the earliest a placement could reach it.

    .venv/bin/python scripts/measure_spares.py --trials 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.bench.scheduler_classes import scheduler_state
from services.common.config import SparesConfig, load_config
from services.launcher.mesh import Mesh, MeshOptions

SLOTS = 4            # vllm max_num_seqs = the serving engine's lease slots (no slack, no P0 reserve)
HOLD_SECONDS = 3.0


def _metric(mesh: Mesh, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{mesh.config.scheduler.metrics_port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith((name + "{", name + " ")))


def _engines(mesh: Mesh) -> list[Any]:
    state = scheduler_state(mesh.endpoints.scheduler)
    return [] if state is None else list(state.engines)


def _wait(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.05)


def _one_spare(mesh: Mesh) -> bool:
    engines = _engines(mesh)
    return len(engines) == 2 and all(e.serving and e.fresh for e in engines) and sum(e.spare for e in engines) == 1


async def _burst(mesh: Mesh, n: int, tokens: int) -> list[int]:
    body = {"model": mesh.config.engines.template.model, "max_tokens": tokens, "temperature": 0}
    headers = {"Authorization": f"Bearer {mesh.api_key}", "X-Priority": "0"}

    async def one(session: aiohttp.ClientSession, i: int) -> int:
        async with session.post(f"{mesh.endpoints.public_http}/v1/completions", headers=headers,
                                json={**body, "prompt": f"Request {i}: tell a story about ships."}) as resp:
            await resp.read()
            return resp.status

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        return list(await asyncio.gather(*(one(session, i) for i in range(n))))


def _promotion_trial(mesh: Mesh) -> dict[str, float]:
    names = ("kvmesh_scheduler_spare_promotion_seconds", "kvmesh_scheduler_spare_first_token_seconds")
    before = {n: (_metric(mesh, n + "_sum"), _metric(mesh, n + "_count")) for n in names}
    statuses = asyncio.run(_burst(mesh, 3 * SLOTS, 32))
    if any(s != 200 for s in statuses):
        raise SystemExit(f"burst failed: {statuses}")
    out: dict[str, float] = {}
    for n in names:
        total, count = _metric(mesh, n + "_sum") - before[n][0], _metric(mesh, n + "_count") - before[n][1]
        out[n.removeprefix("kvmesh_scheduler_spare_")] = total / count if count else float("nan")
    _wait(lambda: _one_spare(mesh), 120, "the engine back to spare")
    return out


def _cold_trial(mesh: Mesh, name: str) -> float:
    old = next(e.incarnation for e in _engines(mesh) if e.engine_id == name)
    mesh.terminate(name)
    mesh.wait(name, 60)
    _wait(lambda: all(e.engine_id != name for e in _engines(mesh)), 60, f"{name} gone")
    began = time.monotonic()
    mesh.respawn(name)
    _wait(lambda: any(e.engine_id == name and e.incarnation != old and e.serving and e.fresh
                      for e in _engines(mesh)), 600, f"{name} serving again")
    seconds = time.monotonic() - began
    _wait(lambda: mesh.started(name), 120, f"{name} healthy")
    _wait(lambda: _one_spare(mesh), 120, "one spare again")
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--model", default="tiny-llama")
    args = parser.parse_args()
    config = load_config(ROOT / "config" / "kvmesh.yaml")
    config.engines.template.vllm.kv_cache_gib = 0.25
    config.engines.template.vllm.max_num_seqs = SLOTS
    config.scheduler.engine_queue_slack = 0
    config.scheduler.p0_reserved_leases = 0
    config.scheduler.preempt_classes = []
    config.scheduler.spares = SparesConfig(count=1, demote_hold_seconds=HOLD_SECONDS)
    (ROOT / ".run").mkdir(exist_ok=True)
    run_dir = Path(tempfile.mkdtemp(prefix="spares-", dir=ROOT / ".run"))
    mesh = Mesh(config, MeshOptions(engines=2, backend="vllm", model=args.model, free_ports=True, run_dir=run_dir))
    mesh.start()
    try:
        _wait(lambda: _one_spare(mesh), 300, "one serving engine and one spare")
        promotions = [_promotion_trial(mesh) for _ in range(args.trials)]
        spare = next(e.engine_id for e in _engines(mesh) if e.spare)
        cold = [_cold_trial(mesh, spare) for _ in range(args.trials)]
    finally:
        mesh.stop_all()
    first = [p["first_token_seconds"] for p in promotions]
    print(json.dumps({"promotions": promotions, "cold_start_seconds": cold}, indent=1))
    print(f"promotion -> first placement: {[round(p['promotion_seconds'], 4) for p in promotions]} s; "
          f"-> first token: {[round(x, 3) for x in first]} s (median {statistics.median(first):.3f}); "
          f"cold start -> serving: {[round(x, 1) for x in cold]} s (median {statistics.median(cold):.1f})")


if __name__ == "__main__":
    main()
