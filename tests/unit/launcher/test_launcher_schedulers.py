"""`kvmesh up --schedulers N` (README "Several schedulers"): N scheduler
children on the port map's ports, every gateway and engine dialling all of
them; one replica is the single `scheduler_address` as before. And the
config's `scheduler_addresses`, validated in the one validation phase."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.common.config import ConfigError, EngineConfig, GatewayConfig, MeshConfig, load_config
from services.common.config.validation import validate_config
from services.launcher.children import Role
from services.launcher.mesh import Mesh, MeshOptions
from services.launcher.port_plan import scheduler_ports

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
