"""`kvmesh top` without a terminal: the screen as a pure function of a
frame, the Prometheus parsing, rates between refreshes, the port plan, and
one gather against an in-process scheduler and fake metrics ports."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc
import pytest
from rich.console import Console

from services.common.config import MeshConfig
from services.ops.top_data import (
    DeadlineRow,
    EngineRow,
    Frame,
    GatewayRow,
    Gatherer,
    QueueRow,
    ScalingRow,
    parse_samples,
    targets,
)
from services.ops.top_render import render


def _text(frame: Frame, width: int = 160) -> str:
    console = Console(width=width, record=True, color_system=None)
    console.print(render(frame, width))
    return console.export_text()


def _frame() -> Frame:
    return Frame(
        taken_at=0.0, scheduler="127.0.0.1:50051", policy="round_robin", leases=3,
        engines=[EngineRow("engine-0", "serving", 0.42, 3, 1, 812.5, "ok"),
                 EngineRow("engine-1", "drained", 0.0, 0, 0, None, "draining")],
        queues=[QueueRow(0, 0, 0.0, False), QueueRow(1, 2, 1.5, False), QueueRow(2, 7, 12.25, True),
                QueueRow(2, 40, 300.0, True, batch=True)],
        gateways=[GatewayRow("gateway-0", 5, 3.25, 2)],
        rejections={"scheduler queue_full": 4}, problems=["127.0.0.1:9: connection refused"])


@pytest.mark.parametrize("width", [160, 90])
def test_screen_shows_engines_queues_gateways_and_rejections(width: int) -> None:
    text = _text(_frame(), width)
    engine0 = next(line for line in text.splitlines() if "engine-0" in line).split()
    assert engine0 == ["engine-0", "serving", "42%", "3", "1", "812.5", "ok"]
    engine1 = next(line for line in text.splitlines() if "engine-1" in line).split()
    assert engine1 == ["engine-1", "drained", "0%", "0", "0", "-", "draining"]
    assert "PAUSED" in next(line for line in text.splitlines() if " P2 " in line)
    assert "12.2 s" in text or "12.3 s" in text
    assert next(line for line in text.splitlines() if "P2 batch" in line).split()[2:4] == ["40", "300.0"]
    assert "round_robin" in text and "leases 3" in text
    assert "gateway-0" in text and "3.2" in text and "queue_full" in text
    assert "! 127.0.0.1:9: connection refused" in text


def test_screen_shows_the_learned_deadlines() -> None:
    frame = _frame()
    frame.deadlines = [DeadlineRow("tiny-llama", 1, "token_stall", 0.4445, 64, 1.3335, "derived"),
                       DeadlineRow("tiny-llama", 1, "queue_wait", 0.0, 0, 300.0, "default")]
    lines = _text(frame).splitlines()
    assert next(line for line in lines if "token_stall" in line).split() == [
        "tiny-llama", "P1", "token_stall", "444", "ms", "64", "1.33", "s", "derived"]
    assert next(line for line in lines if "queue_wait" in line).split() == [
        "tiny-llama", "P1", "queue_wait", "-", "0", "300.00", "s", "default"]


def test_screen_shows_the_scaling_figure() -> None:
    frame = _frame()
    frame.scaling = [ScalingRow("tiny-llama", 3, 2, 0, "queue: P0 waited 0.70 s", True)]
    line = next(line for line in _text(frame).splitlines() if "tiny-llama" in line)
    assert line.split()[:4] == ["tiny-llama", "3", "2", "0"] and "queue: P0 waited" in line


def test_an_empty_fleet_says_so() -> None:
    text = _text(Frame(taken_at=0.0, scheduler="s:1", queues=[QueueRow(c, 0, 0.0, False) for c in range(3)]))
    assert "(none registered)" in text and "(no metrics port known)" in text and "(none)" in text


def test_parse_samples_and_targets() -> None:
    samples = parse_samples('# TYPE x counter\nx_total{a="1"} 3\nx_total{a="2"} 4\ng 1.5\n')
    assert samples[("x_total", (("a", "1"),))] == 3 and samples[("g", ())] == 1.5
    config = MeshConfig()
    config.engines.count = 2
    engines, gateways, scheduler = targets(config, 2)
    base = config.engines.metrics_base_port
    assert engines == {"engine-0": f"127.0.0.1:{base}", "engine-1": f"127.0.0.1:{base + 1}"}
    assert gateways == [f"127.0.0.1:{config.gateway.metrics_port + r}" for r in range(2)]
    assert scheduler == f"127.0.0.1:{config.scheduler.metrics_port}"


class _Metrics(BaseHTTPRequestHandler):
    tokens = 100.0

    def do_GET(self) -> None:
        if self.path == "/health/ready":
            body, status = b'{"status": "ok", "reason": ""}', 200
        else:
            body = (f"vllm:generation_tokens_total {_Metrics.tokens}\n"
                    'kvmesh_gateway_active_streams 2\n'
                    'kvmesh_gateway_requests_total{route="/v1/completions",status="200"} 10\n'
                    'kvmesh_gateway_requests_total{route="/v1/completions",status="429"} 1\n'
                    'kvmesh_gateway_requests_total{route="/health",status="200"} 99\n'
                    'kvmesh_scheduler_rejections_total{reason="queue_full"} 1\n').encode()
            status = 200
        self.send_response(status)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def metrics_port() -> Iterator[int]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Metrics)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


async def test_gather_against_a_scheduler_and_metrics_ports(metrics_port: int) -> None:
    from services.common.clock import FakeClock
    from services.scheduler.server import SchedulerService

    config = MeshConfig()
    config.scheduler.metrics_port = 0
    service = SchedulerService(config, clock=FakeClock())
    port = await service.start(port=0)
    address = f"127.0.0.1:{metrics_port}"
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            gatherer = Gatherer(channel, f"127.0.0.1:{port}", {"engine-0": address}, [address], address)
            try:
                first = await asyncio.to_thread(gatherer.frame)
                _Metrics.tokens = 300.0
                second = await asyncio.to_thread(gatherer.frame)
            finally:
                gatherer.close()
    finally:
        await service.stop(grace=0.2)
    assert first.policy == "predicted_ttft" and first.engines == [] and first.problems == []
    assert [q.priority for q in first.queues] == [0, 1, 2]
    (gw,) = second.gateways
    assert gw.open_streams == 2 and gw.rejections == 1 and gw.requests_per_second == 0.0
    assert first.gateways[0].requests_per_second is None          # a rate needs two looks
    assert second.rejections == {"scheduler queue_full": 1}


def test_rates_follow_counters_and_forget_restarts() -> None:
    gatherer = Gatherer(grpc.insecure_channel("127.0.0.1:9"), "x", {}, [], "")
    try:
        assert gatherer._rate("k", 10.0, 1.0) is None
        assert gatherer._rate("k", 30.0, 3.0) == 10.0
        assert gatherer._rate("k", 5.0, 4.0) is None               # a counter reset: a restarted process
        assert gatherer._rate("k", 15.0, 5.0) == 10.0
    finally:
        gatherer.close()


def test_an_unreachable_mesh_is_reported_not_raised() -> None:
    from services.launcher.ports import free_port

    dead = f"127.0.0.1:{free_port()}"
    with grpc.insecure_channel(dead) as channel:
        gatherer = Gatherer(channel, dead, {"engine-0": dead}, [dead], dead)
        try:
            frame = gatherer.frame()
        finally:
            gatherer.close()
    assert any(p.startswith(f"scheduler {dead}: UNAVAILABLE") for p in frame.problems), frame.problems
    assert any(p.startswith(dead) for p in frame.problems)            # the metrics port too
    assert frame.engines == [] and frame.gateways == [GatewayRow("gateway-0", None, None, None)]
    assert "! scheduler" in _text(frame)
