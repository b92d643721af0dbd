"""The `batch:` block (the Batch API): defaults, the shipped config, and
every bound named by its path."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from services.batch.server import database_path
from services.common.config import BatchConfig, ConfigError, MeshConfig, config_from_dict, load_config, validate_config

ROOT = Path(__file__).resolve().parents[3]


def test_defaults_and_the_shipped_config() -> None:
    assert load_config(ROOT / "config" / "kvmesh.yaml").batch == BatchConfig()
    config = MeshConfig()
    config.run_dir = "/srv/run"
    assert database_path(config) == "/srv/run/batch.sqlite3"  # one file for every gateway of the mesh
    config.batch.database = "/shared/batch.db"
    assert database_path(config) == "/shared/batch.db"


@pytest.mark.parametrize(("block", "message"), [
    ({"max_file_bytes": 100}, "config.batch.max_file_bytes: must be within"),
    ({"max_lines": 0}, "config.batch.max_lines: must be > 0"),
    ({"max_in_flight": 0}, "config.batch.max_in_flight: must be > 0"),
    ({"max_attempts": 0}, "config.batch.max_attempts: must be > 0"),
    ({"lease_seconds": 0}, "config.batch.lease_seconds: must be > 0"),
    ({"lease_seconds": 2, "poll_seconds": 1}, "config.batch.poll_seconds: must be < lease_seconds / 2"),
    ({"completion_window_seconds": 0}, "config.batch.completion_window_seconds: must be > 0"),
    ({"admit_margin_seconds": -1}, "config.batch.admit_margin_seconds: must be >= 0"),
    ({"lease_seconds": 1, "poll_seconds": 0.2, "admit_margin_seconds": 0.8},
     "config.batch.admit_margin_seconds: must be < lease_seconds - poll_seconds"),
    ({"port": 70000}, "config.batch.port"),
    ({"metrics_port": -1}, "config.batch.metrics_port"),
    ({"drain_seconds": 0}, "config.batch.drain_seconds: must be > 0"),
    ({"internal_key_sha256": "abc"}, "config.batch.internal_key_sha256: expected 64 hex digits"),
    ({"gateway_url": "gateway:8000"}, "config.batch.gateway_url: expected http"),
])
def test_out_of_bounds_settings_name_their_path(block: dict[str, Any], message: str) -> None:
    config = config_from_dict(MeshConfig, {"batch": block})
    with pytest.raises(ConfigError, match=message):
        validate_config(config)


def test_an_unknown_key_is_an_error() -> None:
    with pytest.raises(ConfigError, match="batch"):
        config_from_dict(MeshConfig, {"batch": {"max_inflight": 5}})
