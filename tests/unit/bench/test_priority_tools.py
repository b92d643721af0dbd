"""The priority scenarios' tools: one timed chat stream against an in-process
fake server, tokens per time window, the scheduler's per-class figures and
their column in `kvmesh bench`'s table."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from types import SimpleNamespace

import aiohttp
import pytest
from aiohttp import web

from services.bench.report import format_summary
from services.bench.scheduler_classes import class_deltas, class_figures
from services.bench.stats import summarize
from services.bench.timed_stream import ChatCall, TimedStream, chat_stream, tokens_between


async def _chat(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    if request.headers.get("X-Priority") == "2":
        return web.json_response({"error": {"message": "full", "code": "reject_code_tenant_full"}}, status=429,
                                 headers={"Retry-After": "3"})
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for i in range(body["max_tokens"]):
        event = {"choices": [{"index": 0, "delta": {"content": f" t{i}"}, "finish_reason": None}]}
        await resp.write(b"data: " + json.dumps(event).encode() + b"\n\n")
    last = {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}],
            "usage": {"prompt_tokens": 3, "completion_tokens": body["max_tokens"]}}
    await resp.write(b"data: " + json.dumps(last).encode() + b"\n\ndata: [DONE]\n\n")
    return resp


@pytest.fixture
async def base_url() -> AsyncIterator[str]:
    app = web.Application()
    app.router.add_post("/v1/chat/completions", _chat)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    yield f"http://127.0.0.1:{port}"
    await runner.cleanup()


async def test_chat_stream_records_text_times_and_rejections(base_url: str) -> None:
    async with aiohttp.ClientSession() as session:
        ok = await chat_stream(session, ChatCall(base_url, "k", "m", "hi", 5, priority=0))
        no = await chat_stream(session, ChatCall(base_url, "k", "m", "hi", 5, priority=2))
    assert ok.ok and ok.text == " t0 t1 t2 t3 t4" and ok.completion_tokens == 5 and ok.finish_reason == "length"
    assert ok.ttft is not None and ok.first_token is not None and ok.sent <= ok.first_token <= (ok.ended or 0)
    assert [chars for _, chars in ok.marks] == [3, 6, 9, 12, 15]
    assert not no.ok and no.status == 429 and no.error_code == "reject_code_tenant_full" and no.retry_after == "3"
    assert no.answered is not None and no.first_token is None


async def test_chat_stream_reports_transport_failure() -> None:
    async with aiohttp.ClientSession() as session:
        out = await chat_stream(session, ChatCall("http://127.0.0.1:9", "k", "m", "hi", 5, timeout_seconds=5))
    assert not out.ok and out.status == 0 and out.error


def test_tokens_between_splits_by_the_text_that_arrived() -> None:
    s = TimedStream(ChatCall("u", "k", "m", "x", 4), text="aabbccdd", completion_tokens=4,
                    marks=[(1.0, 2), (2.0, 4), (3.0, 6), (4.0, 8)])
    assert tokens_between(s, 0.0, 10.0) == 4
    assert tokens_between(s, 1.5, 3.5) == 2      # the chunks at 2.0 and 3.0
    assert tokens_between(s, 5.0, 6.0) == 0
    assert tokens_between(TimedStream(ChatCall("u", "k", "m", "x", 4)), 0.0, 1.0) == 0


def _state(*rows: tuple[int, int, int, int, float]) -> SimpleNamespace:
    classes = [SimpleNamespace(priority=p, preemptions=n, requeued=r, preempted_now=now, seconds_lost=lost,
                               displaced=0, protected=0) for p, n, r, now, lost in rows]
    return SimpleNamespace(classes=classes)


def test_class_deltas_subtract_counters_and_keep_levels() -> None:
    before = class_figures(_state((2, 3, 3, 1, 1.5)))
    after = class_figures(_state((1, 1, 1, 0, 0.2), (2, 10, 9, 2, 4.0)))
    deltas = class_deltas(before, after)
    assert deltas["P2"]["preemptions"] == 7 and deltas["P2"]["requeued"] == 6
    assert deltas["P2"]["preempted_now"] == 2 and deltas["P2"]["seconds_lost"] == pytest.approx(2.5)
    assert deltas["P1"]["preemptions"] == 1
    assert class_figures(None) == {} and class_figures(SimpleNamespace(classes=[])) == {}


def test_format_summary_shows_preemptions_only_when_read() -> None:
    summary = summarize([], 1.0)
    assert "preempted" not in format_summary(summary)
    summary["scheduler_classes"] = {"P2": {"preemptions": 4, "requeued": 4, "seconds_lost": 1.25}}
    table = format_summary(summary)
    assert "preempted / requeued / s lost" in table
    assert "| 4 / 4 / 1.2 |" in table or "| 4 / 4 / 1.3 |" in table
