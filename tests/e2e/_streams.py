"""Streaming clients and probes the reliability tests share: OpenAI
completions over SSE through Envoy, the gateway's Prometheus counters, the
scheduler's state. Event-driven waits only (no sleeps standing in for them)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import aiohttp
import grpc

from services.bench.scheduler_classes import scheduler_state as get_scheduler_state
from services.bench.sse import SseEvents
from services.common.proto.kvmesh.v1 import engine_pb2, engine_pb2_grpc, scheduler_pb2
from services.launcher.mesh import Mesh

__all__ = [
    "StreamResult",
    "engine_infos",
    "eventually",
    "gateway_counter",
    "run_streams",
    "scheduler_state",
    "set_sim_speed",
    "sim_unthrottled",
    "stream_completion",
    "wait_until",
]

# One stream may take this long in the worst case on a noisy 2-core machine.
STREAM_TIMEOUT_SECONDS = 180.0


@dataclass
class StreamResult:
    """What one client saw. `ok` = HTTP 200, a finish reason of length/stop,
    no error event, and the closing [DONE]."""

    status: int = 0
    text: str = ""
    chunks: int = 0
    finish_reason: str | None = None
    error: str | None = None
    done: bool = False
    first_chunk: asyncio.Event = field(default_factory=asyncio.Event)
    chunk_at: list[float] = field(default_factory=list)  # time.monotonic() of each chunk

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.done and self.error is None and self.finish_reason in ("length", "stop")


async def stream_completion(
    session: aiohttp.ClientSession, mesh: Mesh, prompt: str, max_tokens: int, result: StreamResult | None = None,
    stop: list[str] | None = None, priority: int | None = None,
) -> StreamResult:
    """POST /v1/completions (stream) through Envoy; never raises for a
    failed request, records it in the result instead."""
    result = result or StreamResult()
    body = {"model": mesh.config.engines.template.model, "prompt": prompt, "max_tokens": max_tokens,
            "stream": True, "temperature": 0}
    if stop:
        body["stop"] = stop
    headers = {"Authorization": f"Bearer {mesh.api_key}"}
    if priority is not None:
        headers["X-Priority"] = str(priority)
    try:
        async with asyncio.timeout(STREAM_TIMEOUT_SECONDS):
            async with session.post(f"{mesh.endpoints.public_http}/v1/completions", json=body,
                                    headers=headers) as resp:
                result.status = resp.status
                if resp.status != 200:
                    result.error = (await resp.text())[:300]
                    return result
                events = SseEvents(resp.content)
                async for event in events:
                    if "error" in event:
                        result.error = json.dumps(event["error"])[:300]
                        continue
                    for choice in event.get("choices", ()):
                        result.text += choice.get("text") or ""
                        if choice.get("finish_reason"):
                            result.finish_reason = choice["finish_reason"]
                    result.chunks += 1
                    result.chunk_at.append(time.monotonic())
                    result.first_chunk.set()
                result.done = events.done
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result


async def run_streams(
    mesh: Mesh, prompts: list[str], max_tokens: list[int], stops: list[list[str] | None] | None = None,
) -> tuple[list[StreamResult], list[asyncio.Task[StreamResult]], aiohttp.ClientSession]:
    """Start one stream per prompt (with its stop strings, if given); returns
    the live results, their tasks and the session (the caller awaits the
    tasks, then closes the session)."""
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
    results = [StreamResult() for _ in prompts]
    stops = stops or [None] * len(prompts)
    tasks = [asyncio.create_task(stream_completion(session, mesh, p, n, r, stop))
             for p, n, r, stop in zip(prompts, max_tokens, results, stops, strict=True)]
    return results, tasks, session


async def wait_until(predicate: Callable[[], bool], timeout: float, what: str, poll: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(poll)


async def eventually(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    """Like wait_until, for predicates that block (gRPC calls): each check
    runs in a thread so the test's own streams keep flowing."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await asyncio.to_thread(predicate):
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def engine_infos(mesh: Mesh) -> list[engine_pb2.EngineInfo]:
    """Every engine's GetInfo, straight from its gRPC port."""
    infos = []
    for address in mesh.endpoints.engines:
        with grpc.insecure_channel(address) as channel:
            infos.append(engine_pb2_grpc.EngineStub(channel).GetInfo(engine_pb2.GetInfoRequest(), timeout=5))
    return infos


def gateway_counter(mesh: Mesh, name: str, labels: str = "", replica: int = 0) -> float:
    """A counter from gateway `replica`'s /metrics (0 when absent)."""
    port = mesh.config.gateway.metrics_port + replica
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    wanted = f"{name}{{{labels}}}" if labels else name
    for line in text.splitlines():
        if line.startswith(wanted + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def engine_counters(mesh: Mesh, name: str) -> list[float]:
    """A counter per engine (summed over its labels), from each engine's /metrics."""
    out = []
    for i in range(len(mesh.endpoints.engines)):
        port = mesh.config.engine_config(i).metrics_port
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            text = resp.read().decode()
        out.append(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                       if line.startswith((name + "{", name + " "))))
    return out


def all_placed(mesh: Mesh, streams: int, engines: int = 2) -> bool:
    """`streams` requests hold leases and all `engines` engines serve."""
    state = scheduler_state(mesh)
    return (state is not None and len(state.engines) == engines and all(e.serving for e in state.engines)
            and sum(e.leases for e in state.engines) == streams)


def scheduler_state(mesh: Mesh) -> scheduler_pb2.SchedulerState | None:
    """The scheduler's GetState, None while it is unreachable."""
    state: scheduler_pb2.SchedulerState | None = get_scheduler_state(mesh.endpoints.scheduler)
    return state


def set_sim_speed(mesh: Mesh, factor: float | None) -> None:
    """Every sim engine's run-time speed (POST /sim/speed; None: DELETE,
    back to its schedule): services/engine/sim/speed.py."""
    for i in range(len(mesh.endpoints.engines)):
        port = mesh.config.engine_config(i).metrics_port
        url = f"http://127.0.0.1:{port}/sim/speed" + ("" if factor is None else f"?factor={factor}")
        request = urllib.request.Request(url, method="DELETE" if factor is None else "POST")
        with urllib.request.urlopen(request, timeout=10) as resp:
            assert resp.status == 200


@contextlib.contextmanager
def sim_unthrottled(mesh: Mesh) -> Iterator[None]:
    """The sim engines' steps free (speed factor 0) while the block runs,
    then back to their schedule: for a test's uninterrupted reference run,
    of which it takes only the text -- a pure function of the tokens before
    it, whatever the speed -- and whose seconds of simulated decoding
    showed nothing (they were a fifth of the reliability tests' time)."""
    set_sim_speed(mesh, 0.0)
    try:
        yield
    finally:
        set_sim_speed(mesh, None)
