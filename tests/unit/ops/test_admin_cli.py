"""`kvmesh admin`'s arguments and token sources."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from services.common.config import ConfigError, MeshConfig
from services.ops.admin_cli import parse_priority, read_token
from services.ops.connect import scheduler_address


@pytest.mark.parametrize(("text", "value"), [("P2", 2), ("p0", 0), ("1", 1), (" P1 ", 1)])
def test_priorities(text: str, value: int) -> None:
    assert parse_priority(text) == value


@pytest.mark.parametrize("text", ["P3", "high", "-1", ""])
def test_bad_priorities(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="P0, P1 or P2"):
        parse_priority(text)


def test_token_from_file_then_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    token = tmp_path / "t"
    token.write_text("abc\n")
    assert read_token(str(token)) == "abc"
    monkeypatch.setenv("KVMESH_ADMIN_TOKEN", "from-env")
    assert read_token(None) == "from-env"
    monkeypatch.delenv("KVMESH_ADMIN_TOKEN")
    with pytest.raises(ConfigError, match="no admin token"):
        read_token(None)
    with pytest.raises(ConfigError, match="cannot read"):
        read_token(str(tmp_path / "missing"))
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ConfigError, match="is empty"):
        read_token(str(tmp_path / "empty"))


def test_scheduler_address_from_flag_or_config() -> None:
    config = MeshConfig()
    assert scheduler_address(config, "h:1") == "h:1"
    assert scheduler_address(config, None) == f"127.0.0.1:{config.scheduler.port}"
    config.scheduler.host = "0.0.0.0"
    assert scheduler_address(config, None) == f"127.0.0.1:{config.scheduler.port}"
