"""The lint and type gates: `make test` fails on a ruff or a mypy finding.

Both tools are configured in pyproject.toml ([tool.ruff], [tool.mypy], with
the reasons for the rule set) and installed by its `test` extra. These tests
only run them, with this interpreter (the venv's), on the checkout this file
belongs to, and fail with the tools' own report. A missing tool fails too:
a gate that skips itself would let the next change regress unseen.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# What ruff lints; mypy's files (services/) are set in pyproject.toml.
LINTED = ("services", "tests", "scripts")
# A cold mypy run (no .mypy_cache) takes ~15 s here, a warm one ~1 s; the bound is for a
# loaded 2-core machine.
TIMEOUT_S = 600


def _run(module: str, *args: str) -> subprocess.CompletedProcess[str]:
    if importlib.util.find_spec(module) is None:
        pytest.fail(f"{module} is not installed for {sys.executable}: "
                    "install the test extra (make setup, or pip install -e '.[test]')")
    return subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=TIMEOUT_S, check=False)


def test_ruff_finds_nothing() -> None:
    out = _run("ruff", "check", "--no-fix", "--output-format", "concise", *LINTED)
    if out.returncode != 0:
        pytest.fail(f"ruff check {' '.join(LINTED)} failed (exit {out.returncode}); fix the findings, or add "
                    f"`# noqa: CODE - reason` where the rule is wrong for that line:\n{out.stdout}{out.stderr}",
                    pytrace=False)


def test_mypy_finds_nothing() -> None:
    out = _run("mypy")
    if out.returncode != 0:
        pytest.fail(f"mypy (services/, configured in pyproject.toml) failed (exit {out.returncode}); fix the types, "
                    f"or add `# type: ignore[code]  # reason` where the stubs are wrong:\n{out.stdout}{out.stderr}",
                    pytrace=False)
