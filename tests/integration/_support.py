"""Shared pieces of the integration tests: start a small mesh of real
processes on free ports, talk to it through Envoy (aiohttp), and observe the
scheduler (GetState) and the engines (Prometheus counters).

Every wait is event-driven with a generous deadline: the tests assert what
happened, never how fast.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
import urllib.request
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import grpc
import pytest
from _mesh_stop import stop_test_mesh

from services.bench.sse import SseEvents
from services.common.config import ApiKeyConfig, MeshConfig, load_config
from services.common.proto.kvmesh.v1 import scheduler_pb2, scheduler_pb2_grpc
from services.launcher.mesh import Mesh, MeshOptions, start_on_free_ports

__all__ = [
    "MODEL",
    "ChatResult",
    "auth",
    "cancel_all",
    "chat",
    "counter_delta",
    "engine_counter",
    "get_state",
    "mesh_running",
    "wait_idle",
    "wait_state",
]

ROOT = Path(__file__).resolve().parents[2]
MODEL = "tiny-llama"
# Generous: a noisy two-core machine can stall a process for seconds.
WAIT_SECONDS = 60.0


def mesh_running(
    tmp_dir: Path, tune: Callable[[MeshConfig], None], engines: int = 4,
    extra_keys: dict[str, str] | None = None,
) -> Iterator[Mesh]:
    """A mesh (scheduler, `engines` sim engines, one gateway, Envoy) serving
    tiny-llama, with `tune` applied to the config first. `extra_keys` maps
    an API key to a tenant (ceiling P0). Yields it started; stops it after."""
    if not (ROOT / ".models" / MODEL).is_dir():
        pytest.skip(f".models/{MODEL} is missing: run `make setup`")
    config = load_config(ROOT / "config" / "kvmesh.yaml")
    for key, tenant in (extra_keys or {}).items():
        config.gateway.api_keys.append(ApiKeyConfig(
            sha256=hashlib.sha256(key.encode()).hexdigest(), tenant=tenant, priority_ceiling=0))
    tune(config)
    mesh = start_on_free_ports(config, MeshOptions(engines=engines, backend="sim", model=MODEL,
                                                   free_ports=True, run_dir=tmp_dir))
    try:
        yield mesh
    finally:
        stop_test_mesh(mesh)


# ---------------------------------------------------------------- scheduler


async def get_state(mesh: Mesh) -> scheduler_pb2.SchedulerState:
    async with grpc.aio.insecure_channel(mesh.endpoints.scheduler) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        return await stub.GetState(scheduler_pb2.GetStateRequest(), timeout=10)


async def wait_state(
    mesh: Mesh, predicate: Callable[[scheduler_pb2.SchedulerState], bool], what: str,
    timeout: float = WAIT_SECONDS,
) -> scheduler_pb2.SchedulerState:
    """Poll GetState until `predicate` holds; fail naming `what` and the last state."""
    deadline = time.monotonic() + timeout
    state = await get_state(mesh)
    while not predicate(state):
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}; last state:\n{state}")
        await asyncio.sleep(0.05)
        state = await get_state(mesh)
    return state


async def wait_idle(mesh: Mesh) -> None:
    """No request queued or leased: the next test starts from a quiet mesh."""
    await wait_state(mesh, lambda s: s.queued_total == 0 and s.leases_total == 0, "an idle scheduler")


# ---------------------------------------------------------------- engines


def engine_counter(mesh: Mesh, name: str) -> dict[str, float]:
    """Engine id -> the sum of Prometheus counter `name` (all label sets)
    over its /metrics, for every engine still running."""
    out: dict[str, float] = {}
    for i in range(mesh.config.engines.count):
        engine = mesh.config.engine_config(i)
        if not mesh.is_running(engine.engine_id):
            continue
        url = f"http://127.0.0.1:{engine.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as resp:
            text = resp.read().decode()
        total = 0.0
        for line in text.splitlines():
            if line.startswith((name + "{", name + " ")):
                total += float(line.rsplit(" ", 1)[1])
        out[engine.engine_id] = total
    return out


def counter_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, int]:
    return {k: round(after[k] - before.get(k, 0.0)) for k in after}


# ---------------------------------------------------------------- clients


@dataclass
class ChatResult:
    status: int
    text: str = ""
    usage: dict = field(default_factory=dict)
    headers: dict[str, str] = field(default_factory=dict)
    error: dict = field(default_factory=dict)


def auth(key: str, priority: int | None = None) -> dict[str, str]:
    headers = {"Authorization": f"Bearer {key}"}
    if priority is not None:
        headers["X-Priority"] = str(priority)
    return headers


async def chat(
    session: aiohttp.ClientSession, mesh: Mesh, content: str, max_tokens: int = 4, *,
    priority: int | None = None, key: str | None = None, system: str | None = None,
    on_first_token: Callable[[], Awaitable[None] | None] | None = None,
) -> ChatResult:
    """One streamed chat completion through Envoy. `on_first_token` runs at
    the first content chunk. Non-200 answers come back as a result with the
    error body, not as an exception."""
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": content})
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}}
    url = f"{mesh.endpoints.public_http}/v1/chat/completions"
    async with session.post(url, json=body, headers=auth(key or mesh.api_key, priority)) as resp:
        headers = {k.lower(): v for k, v in resp.headers.items()}
        if resp.status != 200:
            raw = await resp.text()
            try:
                error = json.loads(raw).get("error", {})
            except ValueError:
                error = {"raw": raw}
            return ChatResult(resp.status, headers=headers, error=error)
        result = ChatResult(200, headers=headers)
        first = True
        async for event in SseEvents(resp.content):
            if "error" in event:
                result.error = event["error"]
                continue
            if event.get("usage"):
                result.usage = event["usage"]
            for choice in event.get("choices", []):
                piece = choice.get("delta", {}).get("content") or ""
                if piece and first:
                    first = False
                    if on_first_token is not None:
                        maybe = on_first_token()
                        if maybe is not None:
                            await maybe
                result.text += piece
        return result


async def cancel_all(tasks: list[asyncio.Task]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
