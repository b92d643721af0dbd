"""`kvmesh up --schedulers N` (README "Several schedulers"): N scheduler
children on the port map's ports, every gateway and engine dialling all of
them; one replica is the single `scheduler_address` as before. And the
config's `scheduler_addresses`, validated in the one validation phase. A restarted
replica is in rotation (a rolling restart goes on) once every running engine
reports to it."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from services.common.config import ConfigError, EngineConfig, GatewayConfig, MeshConfig, load_config
from services.common.config.validation import validate_config
from services.common.proto.kvmesh.v1 import scheduler_pb2, scheduler_pb2_grpc
from services.launcher.children import Probe, ProbeKind, Role
from services.launcher.mesh import Mesh, MeshOptions
from services.launcher.port_plan import scheduler_ports
from services.launcher.ports import free_port
from services.launcher.probes import scheduler_fleet
from services.launcher.supervisor import _Child

ROOT = Path(__file__).resolve().parents[3]


def _mesh(tmp_path: Path, schedulers: int) -> Mesh:
    if not (ROOT / ".models" / "tiny-llama").is_dir():
        pytest.skip(".models/tiny-llama not built yet (make setup)")
    options = MeshOptions(free_ports=True, run_dir=tmp_path, model="tiny-llama", schedulers=schedulers)
    return Mesh(load_config(ROOT / "config" / "kvmesh.yaml"), options)


def test_three_schedulers_on_the_port_map_dialled_by_everyone(tmp_path: Path) -> None:
    mesh = _mesh(tmp_path, 3)
    cfg = mesh.config
    ports = [scheduler_ports(cfg, r) for r in range(3)]
    assert [p for p, _ in ports] == [cfg.scheduler.port + r for r in range(3)]
    addresses = [f"127.0.0.1:{p}" for p, _ in ports]
    assert cfg.gateway.schedulers() == cfg.engines.template.schedulers() == addresses
    assert cfg.engine_config(1).schedulers() == addresses
    assert mesh.endpoints.schedulers == addresses and mesh.endpoints.scheduler == addresses[0]
    specs = [s for s in mesh.specs() if s.role is Role.SCHEDULER]
    assert [s.name for s in specs] == ["scheduler", "scheduler-1", "scheduler-2"]
    for spec, (grpc_port, metrics) in zip(specs, ports, strict=True):
        assert spec.argv[-4:] == ["--port", str(grpc_port), "--metrics-port", str(metrics)]
        assert spec.probes[0].target.endswith(f":{grpc_port}")
    assert len({m for _, m in ports}) == 3


def test_one_scheduler_is_the_single_address_as_before(tmp_path: Path) -> None:
    cfg = _mesh(tmp_path, 1).config
    assert cfg.gateway.scheduler_addresses == [] == cfg.engines.template.scheduler_addresses
    assert cfg.gateway.schedulers() == [f"127.0.0.1:{cfg.scheduler.port}"] == cfg.engines.template.schedulers()


def test_schedulers_flag_bounds(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--schedulers"):
        _mesh(tmp_path, 0)
    with pytest.raises(ConfigError, match="--schedulers"):
        _mesh(tmp_path, 11)


def test_scheduler_addresses_are_validated() -> None:
    assert GatewayConfig(scheduler_address="a:1").schedulers() == ["a:1"]
    assert EngineConfig(scheduler_address="").schedulers() == []
    assert EngineConfig(scheduler_addresses=["a:1", "b:2"]).schedulers() == ["a:1", "b:2"]
    for bad, problem in ((["a:1", "a:1"], "listed twice"), (["no-port"], "host:port")):
        config = MeshConfig()
        config.gateway.scheduler_addresses = bad
        with pytest.raises(ConfigError, match=rf"gateway\.scheduler_addresses\[\d\]: .*{problem}"):
            validate_config(config)
        config = MeshConfig()
        config.engines.template.scheduler_addresses = bad
        with pytest.raises(ConfigError, match=rf"engines\.template\.scheduler_addresses\[\d\]: .*{problem}"):
            validate_config(config)


class _StateOnly(scheduler_pb2_grpc.SchedulerServicer):
    """A scheduler that answers GetState with the engines it is given."""

    def __init__(self) -> None:
        self.engines: list[scheduler_pb2.EngineState] = []

    def GetState(self, request: scheduler_pb2.GetStateRequest,  # noqa: N802 - the proto's method name
                 context: grpc.ServicerContext) -> scheduler_pb2.SchedulerState:
        return scheduler_pb2.SchedulerState(engines=self.engines)


@pytest.fixture
def state_server() -> Iterator[tuple[_StateOnly, int]]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = _StateOnly()
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield servicer, port
    finally:
        server.stop(None)


def test_the_fleet_probe_counts_engines_with_fresh_reports(state_server: tuple[_StateOnly, int]) -> None:
    servicer, port = state_server
    probe = Probe(ProbeKind.GRPC_HEALTH, f"127.0.0.1:{port}")
    assert scheduler_fleet(probe) == 0                      # restarted: no engine reconnected yet
    servicer.engines = [scheduler_pb2.EngineState(engine_id="engine-0", fresh=True),
                        scheduler_pb2.EngineState(engine_id="engine-1", fresh=False)]
    assert scheduler_fleet(probe) == 1                      # a registration without a fresh report yet
    servicer.engines[1].fresh = True
    assert scheduler_fleet(probe) == 2
    assert scheduler_fleet(Probe(ProbeKind.GRPC_HEALTH, f"127.0.0.1:{free_port()}")) == -1   # not up


def test_a_scheduler_is_in_rotation_once_every_running_engine_reports_to_it(
        tmp_path: Path, state_server: tuple[_StateOnly, int], monkeypatch: pytest.MonkeyPatch) -> None:
    """What a rolling restart of the replicas (and chaos.py's scheduler
    faults) wait for before the next: engines reconnected, not only the
    replica's own gRPC health."""
    servicer, port = state_server
    mesh = _mesh(tmp_path, 2)
    specs = {s.name: s for s in mesh.specs()}
    specs["scheduler-1"].probes[0] = Probe(ProbeKind.GRPC_HEALTH, f"127.0.0.1:{port}")
    for name in ("scheduler-1", "engine-0", "engine-1"):
        mesh._order.append(name)
        mesh._children[name] = _Child(specs[name], tmp_path / f"{name}.log")
    running = {"engine-0", "engine-1"}
    monkeypatch.setattr(mesh, "is_running", lambda name: name in running)
    assert not mesh.in_rotation("scheduler-1")
    servicer.engines = [scheduler_pb2.EngineState(engine_id="engine-0", fresh=True)]
    assert not mesh.in_rotation("scheduler-1")
    running.discard("engine-1")                             # an engine that is down is not waited for
    assert mesh.in_rotation("scheduler-1")
    running.add("engine-1")
    servicer.engines.append(scheduler_pb2.EngineState(engine_id="engine-1", fresh=True))
    assert mesh.in_rotation("scheduler-1")
