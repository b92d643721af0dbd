"""One streamed chat completion with its timeline: what the priority scenarios
(scripts/scenario_preemption.py, scenario_burst.py, bench_priorities.py) and
tests/e2e/test_e2e_preemption.py measure a request by.

`chat_stream` never raises for a failed request: the `TimedStream` says what
the client saw (status, the 429's code and Retry-After, first-token and end
times on the caller's clock, every content chunk's time and the text so far,
finish reason, usage, whether `[DONE]` came). Times are `time.monotonic()`.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from services.bench.sse import SseEvents

__all__ = ["ChatCall", "TimedStream", "chat_stream", "tokens_between"]


@dataclass(frozen=True)
class ChatCall:
    """Where and what to send: a streamed, greedy chat completion."""

    base_url: str               # e.g. http://127.0.0.1:8080 (Envoy), no /v1
    api_key: str
    model: str
    user: str                   # the one user message
    max_tokens: int
    priority: int | None = None  # X-Priority; None = no header (the server's default, P1)
    timeout_seconds: float = 300.0


@dataclass
class TimedStream:
    """What one client saw of one request. `ok` = HTTP 200, no error event,
    a finish reason of length/stop and the closing [DONE]."""

    call: ChatCall
    sent: float = 0.0
    status: int = 0                    # 0 = no HTTP answer (transport error, timeout)
    answered: float | None = None      # response headers (a 429 arrives here)
    first_token: float | None = None   # first chunk carrying content
    ended: float | None = None         # end of the body
    text: str = ""
    marks: list[tuple[float, int]] = field(default_factory=list)  # (time, len(text)) per content chunk
    finish_reason: str | None = None
    completion_tokens: int = 0
    done: bool = False
    error: str = ""
    error_code: str = ""               # OpenAI error JSON's `code` (e.g. reject_code_tenant_full)
    retry_after: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.done and not self.error and self.finish_reason in ("length", "stop")

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.sent

    @property
    def generation_seconds(self) -> float | None:
        """First token to end: how long the answer took to stream."""
        if self.first_token is None or self.ended is None:
            return None
        return self.ended - self.first_token


def _error_code(body: str) -> str:
    try:
        err = json.loads(body).get("error") or {}
    except (ValueError, AttributeError):
        return ""
    return str(err.get("code") or err.get("type") or "") if isinstance(err, dict) else ""


async def _read(resp: aiohttp.ClientResponse, out: TimedStream) -> None:
    events = SseEvents(resp.content)
    async for event in events:
        if "error" in event:
            out.error = json.dumps(event["error"])[:300]
            continue
        for choice in event.get("choices") or ():
            piece = (choice.get("delta") or {}).get("content") or choice.get("text") or ""
            if piece:
                now = time.monotonic()
                if out.first_token is None:
                    out.first_token = now
                out.text += piece
                out.marks.append((now, len(out.text)))
            if choice.get("finish_reason"):
                out.finish_reason = choice["finish_reason"]
        if event.get("usage"):
            out.completion_tokens = int(event["usage"].get("completion_tokens") or 0)
    out.done = events.done


async def chat_stream(session: aiohttp.ClientSession, call: ChatCall) -> TimedStream:
    """Send `call`, read the whole stream; the result records every failure."""
    out = TimedStream(call, sent=time.monotonic())
    body: dict[str, Any] = {
        "model": call.model, "stream": True, "temperature": 0, "max_tokens": call.max_tokens,
        "ignore_eos": True, "stream_options": {"include_usage": True},
        "messages": [{"role": "user", "content": call.user}],
    }
    headers = {"Authorization": f"Bearer {call.api_key}"}
    if call.priority is not None:
        headers["X-Priority"] = str(call.priority)
    try:
        async with asyncio.timeout(call.timeout_seconds):
            async with session.post(call.base_url.rstrip("/") + "/v1/chat/completions", json=body,
                                    headers=headers) as resp:
                out.status, out.answered = resp.status, time.monotonic()
                if resp.status != 200:
                    text = await resp.text()
                    out.error, out.error_code = text[:300], _error_code(text)
                    out.retry_after = resp.headers.get("Retry-After")
                else:
                    await _read(resp, out)
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"[:300]
    out.ended = time.monotonic()
    return out


def tokens_between(stream: TimedStream, start: float, end: float) -> float:
    """Tokens of `stream` that arrived in [start, end): its chunks' share of
    the text there, scaled to its completion tokens (a chunk may carry several
    tokens, so characters are the finest unit the client sees)."""
    if not stream.marks or not stream.text:
        return 0.0
    tokens = stream.completion_tokens or len(stream.marks)

    def chars_at(t: float) -> int:
        n = 0
        for when, chars in stream.marks:
            if when >= t:
                break
            n = chars
        return n

    return (chars_at(end) - chars_at(start)) * tokens / len(stream.text)
