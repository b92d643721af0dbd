"""vLLM's ipc:// socket names fit in a Unix socket path wherever the clone
lies (services/engine/vllm_backend/env.py socket_tmpdir)."""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.engine.vllm_backend.env import IPC_PATH_MAX, socket_tmpdir


def _socket_path(tmpdir: Path) -> str:
    return f"{tmpdir}/{uuid.uuid4()}"  # how vLLM names them (vllm/utils get_open_zmq_ipc_path)


@pytest.fixture
def short_root() -> Iterator[Path]:
    """A short directory under /tmp (pytest's tmp_path is itself too deep)."""
    root = Path(tempfile.mkdtemp(prefix="kv-", dir="/tmp"))
    yield root
    shutil.rmtree(root, ignore_errors=True)


def test_a_short_directory_is_kept(short_root: Path) -> None:
    preferred = short_root / "tmp"  # not tmp_path: under pytest-xdist it is itself near the limit
    assert len(_socket_path(preferred)) <= IPC_PATH_MAX
    assert socket_tmpdir(preferred, short_root=short_root) == preferred


def test_a_deep_directory_gets_a_short_private_one(tmp_path: Path, short_root: Path) -> None:
    deep = tmp_path.joinpath(*["a-rather-long-directory-name"] * 4, "tmp")
    assert len(_socket_path(deep)) > IPC_PATH_MAX
    short = socket_tmpdir(deep, short_root=short_root)
    assert len(_socket_path(short)) <= IPC_PATH_MAX
    info = short.lstat()
    assert stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid() and stat.S_IMODE(info.st_mode) == 0o700
    assert socket_tmpdir(deep, short_root=short_root) == short  # restarts reuse it
    assert socket_tmpdir(deep / "other", short_root=short_root) != short


def test_a_planted_directory_is_not_used(tmp_path: Path, short_root: Path) -> None:
    deep = tmp_path.joinpath(*["a-rather-long-directory-name"] * 4, "tmp")
    planted = socket_tmpdir(deep, short_root=short_root)
    planted.chmod(0o777)  # as if someone else made it first, open to all
    chosen = socket_tmpdir(deep, short_root=short_root)
    assert chosen != planted and stat.S_IMODE(chosen.lstat().st_mode) == 0o700
    assert len(_socket_path(chosen)) <= IPC_PATH_MAX
