"""A streaming OpenAI client for the client host: /v1/completions (or
/v1/chat/completions: `Stream.chat`) over SSE through Envoy, recording when each chunk arrived (to measure how long a
partition stalls a stream) and the SSE event ids. With `resume`, a stream
that stalls (no byte, not even a heartbeat, for `stall_seconds`) or breaks is
sent again with `Last-Event-ID` and continues where it stopped (one cut
before any event is simply sent again). The one resuming client of the
namespace tests and of `scripts/chaos.py` (loopback and `--netns`).

Runs on the client host: `run_on(host, coro_factory)` runs an asyncio loop on
a thread inside the host's namespace, so every socket it opens is the
client host's.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import aiohttp

from .harness import Host
from .mesh import API_KEY, MODEL, NetnsMesh

__all__ = ["Stream", "run_on", "run_streams", "stream_completion"]

T = TypeVar("T")
STREAM_TIMEOUT = 150.0


@dataclass
class Stream:
    """One request and what its client saw."""

    prompt: str
    max_tokens: int
    status: int = 0
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None
    done: bool = False
    chunk_times: list[float] = field(default_factory=list)
    # When the first text arrived (monotonic; None: none yet): the client's first token.
    first_text_at: float | None = None
    last_event_id: str | None = None
    resumes: int = 0
    # Re-sent from the start: cut before any event (so nothing to resume from).
    resent: int = 0
    model: str = MODEL
    # The `code` of an SSE error event, if one came (the error is in `error`).
    error_code: str | None = None
    # Sent as one user message to /v1/chat/completions instead of a prompt.
    chat: bool = False
    # More request headers (X-Priority) and body fields (response_format).
    headers: dict[str, str] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def chunks(self) -> int:
        return len(self.chunk_times)

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.done and self.error is None and self.finish_reason in ("length", "stop")

    def first_chunk_after(self, t: float) -> float | None:
        return next((c for c in self.chunk_times if c > t), None)

    def resumed_after_stall(self, t: float, stall: float) -> float | None:
        """When the stream flowed again after its first gap longer than
        `stall` from `t` on (a gap that starts before `t` counts from `t`),
        or None. Not simply the first chunk after `t`: chunks already on
        their way, or sent while a slow cut is being applied, come first."""
        previous = t
        for c in self.chunk_times:
            if c <= t:
                continue
            if c - previous > stall:
                return c
            previous = c
        return None


class _Cut(Exception):
    """The stream stalled, or its body ended without [DONE]."""


def _body(s: Stream) -> dict[str, Any]:
    body: dict[str, Any] = {"model": s.model, "max_tokens": s.max_tokens, "stream": True, "temperature": 0, **s.extra}
    if s.chat:
        body["messages"] = [{"role": "user", "content": s.prompt}]
    else:
        body["prompt"] = s.prompt
    return body


async def _read(resp: aiohttp.ClientResponse, s: Stream, stall_seconds: float | None) -> None:
    """Consume one SSE response into `s` until [DONE]; _Cut if it stalls or ends before."""
    event_id = None  # the id of the event being read; it counts as seen once its data is
    while True:
        try:
            async with asyncio.timeout(stall_seconds):
                raw = await resp.content.readline()
        except TimeoutError as exc:
            raise _Cut(f"no byte for {stall_seconds} s") from exc
        if not raw:
            raise _Cut("the body ended without [DONE]")
        line = raw.strip()
        if line.startswith(b"id:"):
            event_id = line[3:].strip().decode()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        s.last_event_id = event_id or s.last_event_id
        if data == b"[DONE]":
            s.done = True
            return
        event = json.loads(data)
        if "error" in event:
            s.error = json.dumps(event["error"])[:300]
            error = event["error"]
            s.error_code = str((error.get("code") if isinstance(error, dict) else None) or "error")
            return
        for choice in event.get("choices", ()):
            s.text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
            if s.first_text_at is None and s.text:
                s.first_text_at = time.monotonic()
            if choice.get("finish_reason"):
                s.finish_reason = choice["finish_reason"]
        s.chunk_times.append(time.monotonic())


async def stream_completion(session: aiohttp.ClientSession, base_url: str, s: Stream,
                            stall_seconds: float | None = None, resume: bool = False, attempts: int = 6,
                            timeout: float = STREAM_TIMEOUT, api_key: str = API_KEY) -> Stream:
    """POST the request; never raises, records failures in `s`. With
    `resume`, a stalled or broken stream is sent again (up to `attempts`
    times in all): with Last-Event-ID if it got an event id, from the start
    if it got nothing yet; one cut after text without an id is given up."""
    headers = {"Authorization": f"Bearer {api_key}", **s.headers}
    path = "chat/completions" if s.chat else "completions"
    try:
        async with asyncio.timeout(timeout):
            for attempt in range(attempts):
                if s.last_event_id is not None:
                    headers["Last-Event-ID"] = s.last_event_id
                try:
                    async with session.post(f"{base_url}/v1/{path}", json=_body(s), headers=headers) as resp:
                        s.status = resp.status
                        if resp.status != 200:
                            s.error = (await resp.text())[:2000]
                            return s
                        await _read(resp, s, stall_seconds)
                        return s
                except (_Cut, aiohttp.ClientError, ValueError) as exc:
                    if not resume or (s.last_event_id is None and s.text):
                        s.error = f"{type(exc).__name__}: {exc}"
                        return s
                    if s.last_event_id is None:
                        s.resent += 1
                    else:
                        s.resumes += 1
                    await asyncio.sleep(0.1 * (attempt + 1))
            s.error = f"gave up after {attempts} attempts"
    except TimeoutError:
        s.error = f"no end after {timeout} s"
    return s


def run_streams(base_url: str, streams: list[Stream], **kw: Any) -> tuple[list[asyncio.Task[Stream]],
                                                                          aiohttp.ClientSession]:
    """Start every stream; the caller awaits the tasks, then closes the session."""
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
    tasks = [asyncio.create_task(stream_completion(session, base_url, s, **kw)) for s in streams]
    return tasks, session


async def wait_until(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.05)


def run_on(host: Host, factory: Callable[[], Awaitable[T]], timeout: float) -> T:
    """factory()'s coroutine on an event loop running inside `host`'s namespace."""
    async def bounded() -> T:
        async with asyncio.timeout(timeout):
            return await factory()

    return host.call(lambda: asyncio.run(bounded()), timeout=timeout + 10)


def expected_answers(mesh: NetnsMesh, prompts: list[str], tokens: int) -> list[str]:
    """The uninterrupted answers (same mesh, nothing cut), with the sim
    unthrottled: only their text counts, a pure function of the tokens
    before it (at the test's speed this run was 13 s of waiting)."""
    streams = [Stream(p, tokens) for p in prompts]

    async def run() -> None:
        tasks, session = run_streams(mesh.public_http, streams)
        try:
            await asyncio.gather(*tasks)
        finally:
            await session.close()

    mesh.set_sim_speed(0.0)
    try:
        run_on(mesh.client, run, timeout=150)
    finally:
        mesh.set_sim_speed(None)
    bad = [s for s in streams if not s.ok]
    assert not bad, f"baseline run failed: {bad[0]}"
    return [s.text for s in streams]
