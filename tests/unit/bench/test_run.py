"""A short `kvmesh bench` run against an in-process fake OpenAI server."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp import web

from services.bench.chart import _plain_png, write_chart
from services.bench.cli import bench
from services.bench.report import format_summary, write_json
from services.bench.runner import Target
from services.bench.workloads import Arrival, ArrivalSpec, WorkloadKind, WorkloadSpec


class FakeServer:
    """Streams `max_tokens` one-word chunks; cached_tokens = the words of a
    system prompt it has seen before; 429 for P2 questions divisible by 5."""

    def __init__(self) -> None:
        self.seen_systems: set[str] = set()
        self.bodies: list[dict] = []
        self.headers: list[dict[str, str]] = []
        # P1 questions: divisible by 3, refused inside the open stream (queue
        # expiry); by 4, an error after some text (a failure).
        self.stream_errors = False

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        self.headers.append(dict(request.headers))
        messages = body["messages"]
        user = messages[-1]["content"]
        number = int(user.split(":")[0].split()[-1]) if user.startswith("Question") else 1
        if request.headers.get("X-Priority") == "2" and number % 5 == 0:
            return web.json_response({"error": {"message": "full"}}, status=429, headers={"Retry-After": "1"})
        system = messages[0]["content"] if messages[0]["role"] == "system" else ""
        prompt = sum(len(m["content"].split()) for m in messages)
        cached = len(system.split()) if system in self.seen_systems else 0
        self.seen_systems.add(system)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        n = body["max_tokens"]
        if self.stream_errors and request.headers.get("X-Priority") == "1" and number % 3 == 0:
            error = {"message": "waited past its deadline", "type": "service_unavailable_error", "code": "expired"}
            await resp.write(b"data: " + json.dumps({"error": error}).encode() + b"\n\n")
            return resp
        if self.stream_errors and request.headers.get("X-Priority") == "1" and number % 4 == 0:
            event = {"choices": [{"index": 0, "delta": {"content": " w0"}}]}
            error = {"message": "ran past its limit", "type": "timeout_error", "code": "timeout"}
            for chunk in (event, {"error": error}):
                await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            return resp
        for i in range(n):
            event = {"choices": [{"index": 0, "delta": {"content": f" w{i}"}}]}
            await resp.write(b"data: " + json.dumps(event).encode() + b"\n\n")
        usage = {"prompt_tokens": prompt, "completion_tokens": n,
                 "prompt_tokens_details": {"cached_tokens": cached}}
        await resp.write(b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp


@pytest.fixture
async def fake() -> AsyncIterator[tuple[FakeServer, str]]:
    server = FakeServer()
    app = web.Application()
    app.router.add_post("/v1/chat/completions", server.chat)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        yield server, f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def test_mixed_priority_open_loop_run_reports_classes_hits_and_rejections(fake, tmp_path: Path) -> None:
    server, url = fake
    spec = WorkloadSpec(WorkloadKind.MIXED_PRIORITY, conversations=40, seed=3, groups=2, context_tokens=30,
                        max_tokens=4)
    run, summary = await bench(spec, ArrivalSpec(Arrival.POISSON, rate=400.0), Target(url, "m", "k"),
                               show_progress=False)
    assert len(run.results) == 40
    rejected = [r for r in run.results if r.rejected]
    assert rejected and all(r.priority == 2 and r.conversation % 5 == 0 for r in rejected)
    assert all(r.ok for r in run.results if not r.rejected)
    o = summary["overall"]
    assert o["ok"] + o["rejected"] == 40 and o["failed"] == 0
    assert o["completion_tokens"] == 4 * o["ok"]
    assert 0 < o["prefix_hit_rate"] < 1  # the first request of each group misses
    assert set(summary["classes"]) <= {"P0", "P1", "P2"}
    assert all(h.get("Authorization") == "Bearer k" for h in server.headers)
    assert all(b["stream_options"] == {"include_usage": True} and b["stream"] for b in server.bodies)
    assert "| all |" in format_summary(summary)
    write_json(tmp_path / "r.json", {"run": "test"}, summary, run.results)
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["summary"]["overall"]["ok"] == o["ok"] and len(doc["requests"]) == 40
    assert "messages" not in doc["requests"][0] and "chunk_gaps" not in doc["requests"][0]
    write_chart(tmp_path / "r.png", run.results, summary, "test")
    _plain_png(tmp_path / "plain.png", summary)
    for name in ("r.png", "plain.png"):
        assert (tmp_path / name).read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


async def test_closed_loop_multi_turn_resends_the_history_with_real_answers(fake) -> None:
    server, url = fake
    spec = WorkloadSpec(WorkloadKind.MULTI_TURN, conversations=6, turns=3, max_tokens=3)
    run, summary = await bench(spec, ArrivalSpec(Arrival.CLOSED, concurrency=2), Target(url, "m"),
                               show_progress=False)
    assert summary["overall"]["ok"] == 18
    # Each result keeps the chat it sent (the floor replays it).
    assert sorted(len(r.messages) for r in run.results) == sorted([2, 4, 6] * 6)
    assert {str(r.messages) for r in run.results} == {str(b["messages"]) for b in server.bodies}
    last_turns = [b["messages"] for b in server.bodies if len(b["messages"]) == 6]
    assert len(last_turns) == 6
    for messages in last_turns:
        assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant", "user"]
        assert messages[2]["content"] == " w0 w1 w2"
    # Later turns resend the same system prompt: the fake counts it cached.
    assert summary["overall"]["prefix_hit_rate"] > 0


async def test_unreachable_endpoint_counts_failures_not_crashes() -> None:
    spec = WorkloadSpec(WorkloadKind.SHARED_PREFIX, conversations=3, context_tokens=10)
    run, summary = await bench(spec, ArrivalSpec(Arrival.CLOSED, concurrency=3),
                               Target("http://127.0.0.1:9", "m", timeout_seconds=5), show_progress=False)
    assert summary["overall"]["failed"] == 3 and all(r.status == 0 and r.error for r in run.results)


async def test_cli_resolves_the_model_and_writes_json_and_chart(fake, tmp_path: Path, capsys) -> None:
    import argparse

    from services.bench.cli import _main, add_parser

    server, url = fake
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    ns = parser.parse_args(["bench", "--url", url, "--model", "m", "--workload", "long_output", "--requests", "6",
                            "--arrival", "gamma", "--rate", "100", "--gamma-shape", "0.5", "--max-tokens", "2",
                            "--long-max-tokens", "5", "--quiet", "--header", "X-Test: yes",
                            "--json", str(tmp_path / "o.json"), "--chart", str(tmp_path / "o.png")])
    assert await _main(ns) == 0
    assert "| all | 6/6 |" in capsys.readouterr().out
    doc = json.loads((tmp_path / "o.json").read_text())
    assert doc["meta"]["workload"] == "long_output" and doc["summary"]["overall"]["ok"] == 6
    assert {r["max_tokens"] for r in doc["requests"]} <= {2, 5}
    assert (tmp_path / "o.png").stat().st_size > 1000
    assert all(h.get("X-Test") == "yes" for h in server.headers)


async def test_cli_runs_cache_pressure_with_its_own_defaults(fake, tmp_path: Path, capsys) -> None:
    import argparse

    from services.bench.cli import _main, add_parser

    server, url = fake
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    ns = parser.parse_args(["bench", "--url", url, "--model", "m", "--workload", "cache_pressure", "--requests",
                            "4", "--groups", "2", "--context-tokens", "40", "--think-seconds", "0", "--rate",
                            "100", "--max-tokens", "2", "--quiet", "--json", str(tmp_path / "p.json")])
    assert await _main(ns) == 0
    assert "| all | 16/16 |" in capsys.readouterr().out  # 4 sessions x the default 4 turns
    assert {len(b["messages"]) for b in server.bodies} == {2, 4, 6, 8}
    assert all(b["messages"][0]["content"].startswith("Group ") for b in server.bodies)
    assert json.loads((tmp_path / "p.json").read_text())["meta"]["rate"] == 100.0


async def test_cli_prints_and_saves_the_floor_when_asked(fake, tmp_path: Path, capsys) -> None:
    import argparse

    from services.bench.cli import _main, add_parser

    _server, url = fake
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    root = Path(__file__).resolve().parents[3]
    base = ["bench", "--url", url, "--model", "m", "--workload", "cache_pressure", "--requests", "3", "--groups",
            "1", "--context-tokens", "300", "--think-seconds", "0", "--rate", "50", "--max-tokens", "2", "--quiet",
            "--floor-profile", str(root / "config" / "sim-profiles" / "llama3-8b-a100.yaml"), "--floor-engines", "2"]
    assert await _main(parser.parse_args(base)) == 2  # the floor needs the tokenizer
    ns = parser.parse_args([*base, "--tokenizer", str(root / ".models" / "tiny-llama"),
                            "--floor-total-blocks", "640", "--json", str(tmp_path / "f.json")])
    assert await _main(ns) == 0
    out = capsys.readouterr().out
    assert "floor (2 x llama3-8b-a100, unbounded KV)" in out and "floor (2 x 640 KV blocks, pooled)" in out
    assert out.count("| all | 12/12 |") == 3
    summary = json.loads((tmp_path / "f.json").read_text())["summary"]
    for floor in (summary["floor"], summary["floor_kv"]):
        assert floor["requests"] == 12 and sum(floor["per_engine"]) == 12 and floor["prefix_hit_rate"] > 0.5


async def test_a_refusal_inside_an_open_stream_is_a_rejection_an_error_after_text_a_failure(fake) -> None:
    server, url = fake
    server.stream_errors = True
    spec = WorkloadSpec(WorkloadKind.MIXED_PRIORITY, conversations=60, seed=3, groups=2, context_tokens=30,
                        max_tokens=4)
    run, summary = await bench(spec, ArrivalSpec(Arrival.POISSON, rate=400.0), Target(url, "m", "k"),
                               show_progress=False)
    p1 = [r for r in run.results if r.priority == 1]
    expired = [r for r in p1 if r.conversation % 3 == 0]
    broken = [r for r in p1 if r.conversation % 4 == 0 and r.conversation % 3 != 0]
    assert expired and broken
    assert all(r.rejected and not r.ok for r in expired)
    assert all(not r.rejected and not r.ok for r in broken)
    assert summary["classes"]["P1"]["failed"] == len(broken)
    reasons = summary["classes"]["P1"]["rejections"]
    assert sum(reasons.values()) == len(expired) and all("past its deadline" in k for k in reasons)
