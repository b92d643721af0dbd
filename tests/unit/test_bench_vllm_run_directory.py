"""scripts/bench_vllm.py keeps a failed run's directory (every log of the
mesh and of `vllm serve` is in it) and says where; a completed run's goes."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_vllm", ROOT / "scripts" / "bench_vllm.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_a_completed_run_leaves_no_directory(tmp_path: Path) -> None:
    with bench().run_directory(tmp_path) as scratch:
        (scratch / "engine-0.log").write_text("served")
    assert not scratch.exists() and list(tmp_path.iterdir()) == []


def test_a_failed_run_keeps_its_directory_and_names_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(RuntimeError, match="no_engine"), bench().run_directory(tmp_path) as scratch:
        (scratch / "engine-0.log").write_text("the cause")
        raise RuntimeError("HTTP 503: no_engine")
    assert (scratch / "engine-0.log").read_text() == "the cause"
    assert str(scratch) in capsys.readouterr().err
