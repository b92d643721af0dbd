"""Drive a workload against an OpenAI-compatible endpoint (aiohttp, streamed
chat completions with `stream_options.include_usage`).

Open loop: each conversation starts at its scheduled offset whatever the
server does (a slow server builds a queue; `lateness` records when the client
itself fell behind). Closed loop: `concurrency` workers each run the next
conversation when their last one ends. A conversation's turns run one after
another, each resending the whole history with the assistant's actual answer.

TTFT = send -> first SSE chunk carrying content; e2e = send -> end of stream;
inter-token = (e2e - TTFT) / (completion_tokens - 1). 429 and 503 count as
rejections (the server's clean "no"), anything else that is not a complete
stream with usage as a failure.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from services.bench.sse import SseEvents
from services.bench.stats import RequestResult
from services.bench.workloads import Arrival, ArrivalSpec, Conversation

__all__ = ["RunResult", "Target", "run_workload"]

REJECT_STATUSES = (429, 503)
# The same refusals inside a stream already open (heartbeats went out while the
# request queued): an error event of these OpenAI types before any text.
REJECT_ERROR_TYPES = ("rate_limit_error", "service_unavailable_error")


@dataclass(frozen=True)
class Target:
    base_url: str                       # e.g. http://127.0.0.1:8080 (no trailing /v1)
    model: str
    api_key: str = ""
    path: str = "/v1/chat/completions"
    headers: dict[str, str] = field(default_factory=dict)
    timeout_seconds: float = 600.0      # one request, end to end
    priority_header: str = "X-Priority"
    # Also put the priority in the body (vLLM's `priority` field), for engines
    # and routers that read it there instead of the header.
    priority_in_body: bool = False


@dataclass
class RunResult:
    results: list[RequestResult]
    duration: float


Progress = Callable[[RequestResult], None]


async def resolve_model(session: aiohttp.ClientSession, base_url: str, api_key: str) -> str:
    """The first model GET /v1/models lists (when the user named none)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with session.get(base_url.rstrip("/") + "/v1/models", headers=headers) as resp:
        body = await resp.json(content_type=None)
    data = body.get("data") or []
    if resp.status != 200 or not data:
        raise RuntimeError(f"GET /v1/models answered {resp.status} with no model: {str(body)[:200]}")
    return str(data[0]["id"])


def _request_of(
    target: Target, conv: Conversation, turn: int, messages: list[dict[str, str]],
) -> tuple[dict[str, Any], dict[str, str]]:
    """The JSON body and headers of one streamed chat turn."""
    body: dict[str, Any] = {
        "model": target.model, "messages": messages, "stream": True,
        "max_tokens": conv.turns[turn].max_tokens, "stream_options": {"include_usage": True},
        # Exact output lengths (the sim ignores EOS at 0 probability; vLLM-based peers honour this).
        "ignore_eos": True,
    }
    headers = dict(target.headers)
    if target.api_key:
        headers["Authorization"] = f"Bearer {target.api_key}"
    if conv.priority is not None:
        headers[target.priority_header] = str(conv.priority)
        if target.priority_in_body:
            body["priority"] = conv.priority
    return body, headers


def _record_usage(result: RequestResult, usage: dict[str, Any]) -> None:
    """Token counts from the final usage chunk; a stream is ok once it had content (or asked for none)."""
    if not usage:
        result.error = "stream ended without a usage chunk (include_usage)"
        return
    result.prompt_tokens = int(usage.get("prompt_tokens") or 0)
    result.completion_tokens = int(usage.get("completion_tokens") or 0)
    result.cached_tokens = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    result.ok = result.ttft is not None or result.completion_tokens == 0
    if not result.ok:
        result.error = "no content chunk before the end of the stream"


async def _one_turn(
    session: aiohttp.ClientSession, target: Target, conv: Conversation, turn: int,
    messages: list[dict[str, str]], t0: float, result: RequestResult,
) -> str:
    """Send one turn, fill `result`; returns the assistant's text."""
    body, headers = _request_of(target, conv, turn, messages)
    sent = time.monotonic()
    result.start = sent - t0
    text: list[str] = []
    usage: dict[str, Any] = {}
    last = sent
    try:
        async with session.post(target.base_url.rstrip("/") + target.path, json=body, headers=headers) as resp:
            result.status = resp.status
            if resp.status != 200:
                result.rejected = resp.status in REJECT_STATUSES
                result.error = f"HTTP {resp.status}: {(await resp.text())[:160]}"
                return ""
            async for event in SseEvents(resp.content):
                if "error" in event:
                    error = event["error"]
                    result.error = f"stream error: {str(error)[:160]}"
                    result.rejected = not text and isinstance(error, dict) and error.get("type") in REJECT_ERROR_TYPES
                    return "".join(text)
                piece = "".join((c.get("delta") or {}).get("content") or c.get("text") or ""
                                for c in event.get("choices") or [])
                if piece:
                    now = time.monotonic()
                    if result.ttft is None:
                        result.ttft = now - sent
                    else:
                        result.chunk_gaps.append(now - last)
                    last = now
                    result.chunks += 1
                    text.append(piece)
                if event.get("usage"):
                    usage = event["usage"]
    except (TimeoutError, aiohttp.ClientError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"[:200]
        return "".join(text)
    result.e2e = time.monotonic() - sent
    _record_usage(result, usage)
    return "".join(text)


async def _conversation(
    session: aiohttp.ClientSession, target: Target, conv: Conversation, t0: float,
    lateness: float, sink: list[RequestResult], progress: Progress | None,
) -> None:
    messages: list[dict[str, str]] = [{"role": "system", "content": conv.system}] if conv.system else []
    for k, turn in enumerate(conv.turns):
        if k and conv.think_seconds > 0:
            await asyncio.sleep(conv.think_seconds)
        messages.append({"role": "user", "content": turn.user})
        result = RequestResult(conv.index, k, conv.priority, conv.group, max_tokens=turn.max_tokens,
                               lateness=lateness if k == 0 else 0.0, messages=list(messages))
        answer = await _one_turn(session, target, conv, k, result.messages, t0, result)
        sink.append(result)
        if progress is not None:
            progress(result)
        if not result.ok:
            return  # the rest of a broken chat would not be the same workload
        messages.append({"role": "assistant", "content": answer})


async def run_workload(
    conversations: list[Conversation], arrival: ArrivalSpec, target: Target,
    progress: Progress | None = None, session: aiohttp.ClientSession | None = None,
) -> RunResult:
    """Run every conversation; returns each turn's result and the makespan."""
    own = session is None
    if session is None:
        session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0),
            timeout=aiohttp.ClientTimeout(total=target.timeout_seconds),
        )
    sink: list[RequestResult] = []
    try:
        t0 = time.monotonic()
        if arrival.kind is Arrival.CLOSED:
            queue = list(reversed(conversations))

            async def worker() -> None:
                while queue:
                    await _conversation(session, target, queue.pop(), t0, 0.0, sink, progress)

            await asyncio.gather(*(worker() for _ in range(arrival.concurrency)))
        else:
            async def scheduled(conv: Conversation) -> None:
                delay = t0 + conv.at - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                late = max(0.0, time.monotonic() - (t0 + conv.at))
                await _conversation(session, target, conv, t0, late, sink, progress)

            await asyncio.gather(*(scheduled(c) for c in conversations))
        duration = time.monotonic() - t0
    finally:
        if own:
            await session.close()
    sink.sort(key=lambda r: (r.conversation, r.turn))
    return RunResult(sink, duration)
