"""The `responses:` block (the Responses API's store): defaults, the shipped
config, and every bound named by its path."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from services.common.config import (
    ConfigError,
    MeshConfig,
    ResponsesConfig,
    config_from_dict,
    load_config,
    validate_config,
)

ROOT = Path(__file__).resolve().parents[3]


def test_defaults_and_the_shipped_config() -> None:
    assert MeshConfig().responses == ResponsesConfig(ttl_seconds=3600.0, max_entries=10000, max_bytes=64 * 1024 * 1024)
    assert load_config(ROOT / "config" / "kvmesh.yaml").responses == ResponsesConfig()


@pytest.mark.parametrize(("block", "message"), [
    ({"ttl_seconds": 0}, "config.responses.ttl_seconds: must be > 0"),
    ({"max_bytes": 0}, "config.responses.max_bytes: must be > 0"),
    ({"max_entries": -1}, "config.responses.max_entries: must be >= 0"),
])
def test_out_of_bounds_settings_name_their_path(block: dict[str, Any], message: str) -> None:
    config = config_from_dict(MeshConfig, {"responses": block})
    with pytest.raises(ConfigError, match=message):
        validate_config(config)


def test_an_unknown_key_is_an_error() -> None:
    with pytest.raises(ConfigError, match="responses"):
        config_from_dict(MeshConfig, {"responses": {"ttl": 5}})
