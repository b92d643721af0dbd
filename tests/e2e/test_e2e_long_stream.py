"""A stream longer than two minutes through the real Envoy is not cut.

The sim is slowed so that one token takes ~12 s, longer than this edge's
stream idle timeout (10 s): only the gateway's heartbeats (every 3 s: SSE
comments on the OpenAI route, heartbeat events on gRPC and the bridge) keep
the streams alive. Three streams run side by side for > 120 s: OpenAI SSE
(HTTP/1.1 upstream), the transcoded SSE bridge and native gRPC (HTTP/2
upstream). Deliberately one long test.

The run itself (_long_stream.py: its own mesh, the three streams) starts
in the background once this test is collected (tests/e2e/conftest.py
`LongStreamRun`): two minutes of waiting that would otherwise add two
minutes to the suite. This test reads what it saw and asserts on it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tests.e2e.conftest import LongStreamRun  # by full name: mypy's bare `conftest` is the gateway tests'


def test_streams_over_two_minutes_with_heartbeats_are_not_cut(long_stream_run: LongStreamRun) -> None:
    run = long_stream_run.result()
    assert "error" not in run, run["error"]
    elapsed = run["elapsed"]
    assert elapsed > 120, f"the streams took only {elapsed:.0f} s; the test needs more than two minutes"
    chunks, heartbeats, reason = run["openai"]
    assert reason == "length" and chunks >= 1
    assert heartbeats >= 10
    for kinds in (run["bridge"], run["grpc"]):
        assert kinds[-1] == "finished", kinds
        assert kinds.count("heartbeat") >= 10
        assert kinds.count("delta") >= 1
    assert run["exited"] == [], f"{run['exited']} (logs: {run['logs']})"
