"""Rolling restarts (services/launcher/rolling.py): one child at a time, each
back in rotation before the next stops; one that outlives its stop grace is
killed; Envoy's /clusters decides "in rotation"."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator

import pytest

from services.launcher.children import MeshError
from services.launcher.rolling import envoy_healthy, roll


class FakeChildren:
    def __init__(self, hung: set[str] | None = None) -> None:
        self.calls: list[str] = []
        self.hung = hung or set()
        self.back: set[str] = set()

    def terminate(self, name: str) -> None:
        self.calls.append(f"term {name}")

    def wait(self, name: str, timeout: float) -> int | None:
        self.calls.append(f"wait {name} {timeout:g}")
        return None if name in self.hung else 0

    def kill(self, name: str) -> None:
        self.calls.append(f"kill {name}")

    def restart(self, name: str) -> None:
        self.calls.append(f"restart {name}")

    def stop_grace(self, name: str) -> float:
        return 40.0

    def in_rotation(self, name: str) -> bool:
        # Not at the first look: the roll must wait for the load balancer.
        if name in self.back:
            self.calls.append(f"in rotation {name}")
            return True
        self.back.add(name)
        return False


def test_one_at_a_time_each_back_in_rotation_before_the_next() -> None:
    children = FakeChildren(hung={"gateway-1"})
    steps = roll(children, ["gateway-0", "gateway-1"], children.in_rotation, threading.Event())
    assert children.calls == [
        "term gateway-0", "wait gateway-0 40", "restart gateway-0", "in rotation gateway-0",
        "term gateway-1", "wait gateway-1 40", "kill gateway-1", "restart gateway-1", "in rotation gateway-1",
    ]
    assert [(s.name, s.exit_code) for s in steps] == [("gateway-0", 0), ("gateway-1", None)]


def test_interrupted_while_waiting_for_rotation() -> None:
    cancel = threading.Event()
    cancel.set()
    with pytest.raises(MeshError, match="interrupted"):
        roll(FakeChildren(), ["gateway-0"], lambda name: False, cancel)


CLUSTERS = """gateway_grpc::127.0.0.1:7001::health_flags::healthy
gateway_http::127.0.0.1:7000::health_flags::healthy
gateway_grpc::127.0.0.1:7101::health_flags::/failed_active_hc
gateway_http::127.0.0.1:7100::health_flags::healthy
"""


@pytest.fixture
def admin_port() -> Iterator[int]:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = CLUSTERS.encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


def test_envoy_healthy_needs_both_clusters(admin_port: int) -> None:
    assert envoy_healthy(admin_port, "127.0.0.1:7000", "127.0.0.1:7001")
    assert not envoy_healthy(admin_port, "127.0.0.1:7100", "127.0.0.1:7101")  # gRPC check failing
    assert not envoy_healthy(admin_port, "127.0.0.1:7200", "127.0.0.1:7201")  # not an endpoint


def test_supervise_rolls_the_gateways_when_asked(capsys: pytest.CaptureFixture[str]) -> None:
    from services.launcher.rolling import RollStep
    from services.launcher.up import supervise

    stop, roll_event = threading.Event(), threading.Event()

    class FakeMesh:
        rolls = 0

        def exited(self) -> list[object]:
            return []

        def autoscaler(self) -> None:
            return None   # a fixed fleet

        def rolling_restart(self) -> list[RollStep]:
            self.rolls += 1
            stop.set()
            return [RollStep("gateway-0", 0, 1.0), RollStep("gateway-1", 0, 1.5)]

    mesh = FakeMesh()
    roll_event.set()  # what SIGUSR1 to `kvmesh up` does
    supervise(mesh, stop, roll_event)  # type: ignore[arg-type]  # a fake mesh: only what supervise() calls
    assert mesh.rolls == 1 and not roll_event.is_set()
    assert "rolling restart done: gateway-0 in 1.0 s, gateway-1 in 1.5 s" in capsys.readouterr().err


def test_an_edge_slower_than_the_gateways_unready_wait_is_refused(tmp_path: object) -> None:
    import dataclasses
    from pathlib import Path

    from services.common.config import MeshConfig
    from services.edge.topology import HealthCheckSpec
    from services.launcher.envoy_config import load_run_topology, render_envoy

    config = MeshConfig()
    topology = load_run_topology(config, envoy=True)
    assert topology is not None
    assert topology.health_check.removal_seconds == 3.0 == config.gateway.drain_unready_seconds
    assert "gateway_http" in render_envoy(config, topology, 2, Path(str(tmp_path)))
    slow = dataclasses.replace(topology, health_check=HealthCheckSpec(interval_seconds=5.0))
    with pytest.raises(MeshError, match="drain_unready_seconds"):
        render_envoy(config, slow, 2, Path(str(tmp_path)))
