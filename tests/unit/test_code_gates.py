"""The lint and type gates: `make test` fails on a ruff or a mypy finding, or
on a type-ignore comment that does not say why.

Both tools are configured in pyproject.toml ([tool.ruff], [tool.mypy], with
the reasons for the rule set) and installed by its `test` extra. These tests
only run them, with this interpreter (the venv's), on the checkout this file
belongs to, and fail with the tools' own report. A missing tool fails too:
a gate that skips itself would let the next change regress unseen.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
import tomllib
from pathlib import Path
from types import ModuleType

import pytest

from tests._scripts import load_script

ROOT = Path(__file__).resolve().parents[2]
# What ruff lints and mypy checks (mypy's runs: scripts/typecheck.py, pyproject.toml).
LINTED = ("services", "tests", "scripts")
GENERATED = ROOT / "services" / "common" / "proto"
# mypy over services/, scripts/ and tests/ (both runs of scripts/typecheck.py, one shared .mypy_cache):
# cold 31 s of CPU (36 s wall on a 2-core machine at load ~3, 73 s at load ~5), warm 2 s; services/
# alone is 9 s cold. The bound is for a loaded 2-core machine.
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
    if importlib.util.find_spec("mypy") is None:
        pytest.fail(f"mypy is not installed for {sys.executable}: "
                    "install the test extra (make setup, or pip install -e '.[test]')")
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "typecheck.py")], cwd=ROOT, capture_output=True,
                         text=True, timeout=TIMEOUT_S, check=False)
    if out.returncode != 0:
        pytest.fail(f"mypy (scripts/typecheck.py: services/, scripts/, tests/; pyproject.toml) failed "
                    f"(exit {out.returncode}); fix the types, or add `# type: ignore[code]  # reason` where "
                    f"the stubs are wrong:\n{out.stdout}{out.stderr}", pytrace=False)


# A type-ignore comment with its codes, then `# reason` on the same line.
IGNORE = re.compile(r"#\s*type:\s*ignore\b(?P<codes>\[[^\]]*\])?(?P<rest>.*)$")
REASON = re.compile(r"^\s*#\s*\S")


def _ignores_without_reason() -> list[str]:
    found: list[str] = []
    for folder in LINTED:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if GENERATED in path.parents:
                continue
            for number, line in enumerate(path.read_text().splitlines(), 1):
                hit = IGNORE.search(line)
                if hit and not (hit["codes"] and REASON.match(hit["rest"])):
                    found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    return found


def test_every_type_ignore_says_why() -> None:
    missing = _ignores_without_reason()
    assert not missing, ("each type-ignore comment names its codes and says why on the same line, "
                         "`...  # type" ": ignore[code]  # why the checker is wrong here`:\n" + "\n".join(missing))


def test_the_ignore_gate_tells_a_reason_from_none() -> None:
    tag = "# type" ": ignore"  # split so that this file does not hold the comments it tests
    explained = IGNORE.search(f"x = f()  {tag}[arg-type]  # a fake engine view")
    assert explained is not None and explained["codes"] and REASON.match(explained["rest"])
    for bare in (f"x = f()  {tag}[arg-type]", f"x = f()  {tag}", f"x = f()  {tag}  # why", f"x = f()  {tag}[misc] #"):
        hit = IGNORE.search(bare)
        assert hit is not None and not (hit["codes"] and REASON.match(hit["rest"])), bare


def _typecheck() -> ModuleType:
    return load_script("typecheck")


def test_every_mypy_override_names_a_checked_module() -> None:
    # The stale check mypy's warn_unused_configs would make, were each run not blind to the other's half.
    overrides = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]["overrides"]
    ours = [m for o in overrides for m in o["module"]
            if "disable_error_code" in o or "enable_error_code" in o]
    checked = _typecheck().checked_modules()
    stale = [m for m in ours if not m.endswith(".*") and m not in checked]
    assert not stale, f"pyproject.toml's [[tool.mypy.overrides]] name modules that are gone: {stale}"


def test_every_script_is_checked_with_every_code() -> None:
    # scripts/typecheck.py names the scripts bare (chaos, bench_peers): pyproject's strict override lists each.
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]
    strict = next(o["module"] for o in config["overrides"] if "scripts.*" in o["module"])
    scripts = {p.stem for p in (ROOT / "scripts").glob("*.py")}
    assert scripts <= set(strict), f"add to the services/scripts override in pyproject.toml: {scripts - set(strict)}"
    stale = {m for m in strict if "." not in m} - scripts
    assert not stale, f"scripts no longer there, remove from the override in pyproject.toml: {stale}"
