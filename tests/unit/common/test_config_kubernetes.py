"""What the Kubernetes manifests need from the config and the CLI: bind
hosts on every interface (also with mesh TLS), the scheduler by its Service
name, an engine's id and announced DNS name from flags, API keys from a
mounted Secret file."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest
import yaml

from services import cli
from services.common.config import ConfigError, GatewayConfig, MeshConfig, config_from_dict, validate_config
from services.gateway.keys import KeyStore

POD = "kvmesh-engine-2"
ADVERTISED = f"{POD}.kvmesh-engine.kvmesh.svc.cluster.local:50100"


def sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def _pod_config(tmp_path: Path) -> Path:
    """A kvmesh.yaml as the ConfigMap holds it: wildcard binds, DNS names, TLS."""
    data: dict[str, Any] = {
        "mesh_tls": {"enabled": True, "cert_dir": "/etc/kvmesh/tls"},
        "scheduler": {"host": "0.0.0.0", "port": 50051, "metrics_port": 9101},
        "gateway": {"host": "::", "http_port": 8000, "grpc_port": 50061, "metrics_port": 9102,
                    "scheduler_address": "kvmesh-scheduler:50051",
                    "api_keys_file": "/etc/kvmesh/api-keys/api-keys.yaml"},
        "engines": {"base_port": 50100, "metrics_base_port": 9200, "backend": "sim",
                    "template": {"host": "0.0.0.0", "scheduler_address": "kvmesh-scheduler:50051"}},
    }
    path = tmp_path / "kvmesh.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_wildcard_binds_and_service_names_load_with_mesh_tls(tmp_path: Path) -> None:
    config = cli._config(cli._parser().parse_args(["--config", str(_pod_config(tmp_path)), "scheduler"]))
    assert config.mesh_tls.enabled
    assert config.scheduler.host == "0.0.0.0" and config.gateway.host == "::"
    engine = config.engine_config(0)
    assert (engine.host, engine.port, engine.metrics_port) == ("0.0.0.0", 50100, 9200)
    assert engine.scheduler_address == config.gateway.scheduler_address == "kvmesh-scheduler:50051"


def test_advertise_address_is_validated() -> None:
    def check(address: str) -> None:
        validate_config(config_from_dict(MeshConfig, {"engines": {"template": {"advertise_address": address}}}))

    check(ADVERTISED)
    check("[fd00::2]:50100")
    with pytest.raises(ConfigError, match=r"engines\.template\.advertise_address: 'engine-0': expected host:port"):
        check("engine-0")
    with pytest.raises(ConfigError, match=r"advertise_address: .*needs brackets"):
        check("fd00::2:50100")


def test_engine_flags_set_id_and_announced_address(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[Any] = []

    async def fake_serve(config: MeshConfig, engine: Any) -> None:
        seen.append(engine)

    monkeypatch.setattr("services.engine.server.serve", fake_serve)
    cli.main(["--config", str(_pod_config(tmp_path)), "engine", "--engine-id", POD,
              "--advertise-address", ADVERTISED])
    (engine,) = seen
    assert (engine.engine_id, engine.advertise_address, engine.port) == (POD, ADVERTISED, 50100)
    cli.main(["--config", str(_pod_config(tmp_path)), "engine", "--index", "1"])
    assert (seen[1].engine_id, seen[1].advertise_address, seen[1].port) == ("engine-1", "", 50101)


@pytest.mark.parametrize("flags", [["--advertise-address", "10.0.0.1"], ["--engine-id", ""]])
def test_bad_engine_flags_are_config_errors(flags: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["engine", *flags])
    assert exit_info.value.code == 2
    assert "config error: --" in capsys.readouterr().err


def test_api_keys_come_from_a_mounted_file_too(tmp_path: Path) -> None:
    keys = tmp_path / "api-keys.yaml"
    keys.write_text(yaml.safe_dump({"api_keys": [
        {"sha256": sha("from-secret"), "tenant": "team-a", "priority_ceiling": 1, "models": ["m"]}]}))
    store = KeyStore(GatewayConfig(api_keys_file=str(keys)))
    principal = store.authenticate("from-secret")
    assert (principal.tenant, principal.priority_ceiling, principal.models) == ("team-a", 1, frozenset({"m"}))
    with pytest.raises(Exception, match="invalid API key"):
        store.authenticate("other")


@pytest.mark.parametrize(("document", "message"), [
    ({"api_keys": [{"sha256": "nothex", "tenant": "t"}]}, r"api-keys.yaml: api_keys\[0\].sha256: expected 64 hex"),
    ({"api_keys": [{"sha256": sha("k"), "tenant": ""}]}, r"api_keys\[0\].tenant: required"),
    ({"api_keys": [{"sha256": sha("in-config"), "tenant": "t"}]}, r"api_keys\[0\].sha256: duplicate key"),
    ({"keys": []}, "unknown setting"),
])
def test_a_bad_key_file_names_the_file_and_entry(tmp_path: Path, document: dict[str, Any], message: str) -> None:
    keys = tmp_path / "api-keys.yaml"
    keys.write_text(yaml.safe_dump(document))
    config = GatewayConfig(api_keys_file=str(keys))
    in_config = {"api_keys": [{"sha256": sha("in-config"), "tenant": "c"}]}
    config.api_keys = config_from_dict(GatewayConfig, in_config).api_keys
    with pytest.raises(ConfigError, match=message):
        KeyStore(config)


def test_a_missing_key_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"gateway\.api_keys_file: cannot read"):
        KeyStore(GatewayConfig(api_keys_file=str(tmp_path / "absent.yaml")))
