"""Type-check services/, scripts/ and tests/: mypy in the two runs the code's imports need.

    .venv/bin/python scripts/typecheck.py

Run by `make lint` and by tests/unit/test_code_gates.py. The first run is plain
`python -m mypy`: pyproject.toml's [tool.mypy], every module named by its path
from the repository root. Its `exclude` list holds the code that imports by
bare names, the way it runs (pytest puts tests/ and each test folder without an
__init__.py on sys.path; a script runs with scripts/ first), each with the
reason; this script checks exactly those files in a second run, with the
folders they run from as import roots (MYPYPATH). No file is left out:
excluding one from the first run moves it to the second.

In the second run a file is named as it is imported: bare (`conftest`,
`_streams`, `bench_peers`) for a file in one of the roots or in a package
inside one, by its full path for a package directly under tests/
(tests.fuzz.targets: scripts/fuzz.py imports it so; pytest's `fuzz.targets`
would clash with scripts/fuzz.py), and for a conftest.py that nothing imports
bare (only the gateway tests' one is: `from conftest import Mesh`). So no
module name stands for two files across the runs, and both share one warm
.mypy_cache. Prints mypy's report; exits non-zero when either run finds
anything.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

__all__ = ["BARE_CONFTEST", "ROOTS", "checked_modules", "main", "second_run_args"]

ROOT = Path(__file__).resolve().parents[1]
# Folders the bare-named code runs from: scripts/ (python scripts/NAME.py),
# tests/ (the rootdir conftest's folder), and each test folder without an
# __init__.py whose files import one another. tests/vllm is one so that its
# tests are not named `vllm.*` (the vLLM package).
# Searched in this order (mypy's -m finds the first match): the deeper test
# folders before tests/, so `conftest` is the gateway tests' one.
ROOTS = ("tests/unit/gateway", "tests/unit/engine", "tests/e2e", "tests/vllm", "scripts", "tests")
# The one conftest.py imported by its bare name.
BARE_CONFTEST = "tests/unit/gateway/conftest.py"


def _excluded(config: Path) -> list[str]:
    """The files the first run leaves to this one: pyproject's [tool.mypy] exclude."""
    mypy = tomllib.loads(config.read_text())["tool"]["mypy"]
    patterns = [re.compile(p) for p in mypy.get("exclude", [])]
    found: list[str] = []
    for folder in mypy["files"]:
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if any(p.search(rel) for p in patterns):
                found.append(rel)
    return found


def _by_path(rel: str) -> bool:
    parts = rel.split("/")
    in_test_package = parts[0] == "tests" and len(parts) > 2 and (ROOT / "tests" / parts[1] / "__init__.py").exists()
    loose_conftest = (parts[-1] == "conftest.py" and rel != BARE_CONFTEST
                      and not (ROOT / rel).with_name("__init__.py").exists())
    return in_test_package or loose_conftest


def _dotted(rel: str) -> str:
    return rel.removesuffix(".py").removesuffix("/__init__").replace("/", ".")


def _bare_name(rel: str) -> str:
    """The name a file has under its own root; mypy must find that file first for that name."""
    root = max((r for r in ROOTS if rel.startswith(r + "/")), key=len)
    name = _dotted(rel[len(root) + 1:])
    first = next(r for r in ROOTS if (ROOT / r / rel[len(root) + 1:]).exists())
    if first != root:
        raise SystemExit(f"{rel}: its bare name {name!r} is found in {first}/ first; reorder ROOTS or rename it")
    return name


def second_run_args(config: Path = ROOT / "pyproject.toml") -> list[str]:
    """mypy's arguments for the bare-named code: `-m NAME` for each file, as it is imported."""
    args: list[str] = []
    for rel in _excluded(config):
        args += ["-m", _dotted(rel) if _by_path(rel) else _bare_name(rel)]
    return args


def checked_modules(config: Path = ROOT / "pyproject.toml") -> set[str]:
    """Every module name the two runs give our own files (for checking pyproject's overrides)."""
    mypy = tomllib.loads(config.read_text())["tool"]["mypy"]
    excluded = set(_excluded(config))
    first = {_dotted(path.relative_to(ROOT).as_posix()) for folder in mypy["files"]
             for path in (ROOT / folder).rglob("*.py") if path.relative_to(ROOT).as_posix() not in excluded}
    return first | set(second_run_args(config)[1::2])


def main() -> int:
    env = dict(os.environ, MYPYPATH=os.pathsep.join(str(ROOT / r) for r in ROOTS))
    first = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, check=False)
    second = subprocess.run([sys.executable, "-m", "mypy", *second_run_args()], cwd=ROOT, env=env, check=False)
    return first.returncode or second.returncode


if __name__ == "__main__":
    sys.exit(main())
