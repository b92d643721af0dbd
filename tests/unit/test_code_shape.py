"""Size limits for services/: no module over 450 lines, no function over 60.

A module that outgrows 450 lines holds more than one concern, and a function
over 60 lines does more than one step; both are split rather than grown. The
count is physical lines, docstring and comments included (a function runs
from its `def` line to its last line; a nested function counts toward its
outer one as well as on its own). Generated protobuf stubs
(services/common/proto) are not ours to shape. Literal tables (a long dict
or list of data) may be exempted in EXEMPT with the reason; a stale
exemption fails too, so the list only shrinks.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SERVICES = ROOT / "services"
GENERATED = SERVICES / "common" / "proto"
MAX_MODULE_LINES = 450
MAX_FUNCTION_LINES = 60

# "services/path.py" (a whole module) or "services/path.py::Qual.name" (one
# function) -> why it may exceed the limit. Only literal tables belong here.
EXEMPT: dict[str, str] = {}


@dataclass(frozen=True)
class Function:
    path: str        # relative to the repository root
    qualname: str    # Class.method, outer.inner
    line: int
    lines: int

    @property
    def key(self) -> str:
        return f"{self.path}::{self.qualname}"


def _modules() -> list[Path]:
    return sorted(p for p in SERVICES.rglob("*.py") if GENERATED not in p.parents)


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _functions(tree: ast.AST, path: str, prefix: str = "") -> Iterator[Function]:
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            name = prefix + node.name
            assert node.end_lineno is not None
            yield Function(path, name, node.lineno, node.end_lineno - node.lineno + 1)
            yield from _functions(node, path, name + ".")
        elif isinstance(node, ast.ClassDef):
            yield from _functions(node, path, prefix + node.name + ".")
        else:
            # Functions defined under if/try/with blocks keep the enclosing name.
            yield from _functions(node, path, prefix)


def _all_functions() -> list[Function]:
    found: list[Function] = []
    for module in _modules():
        found.extend(_functions(ast.parse(module.read_text(), str(module)), _rel(module)))
    return found


def test_no_module_over_the_limit() -> None:
    sizes = {_rel(m): len(m.read_text().splitlines()) for m in _modules()}
    offenders = sorted(
        (lines, path) for path, lines in sizes.items() if lines > MAX_MODULE_LINES and path not in EXEMPT
    )
    if offenders:
        pytest.fail(
            f"{len(offenders)} module(s) in services/ over {MAX_MODULE_LINES} lines; split each by concern:\n"
            + "\n".join(f"  {path}: {lines} lines" for lines, path in reversed(offenders)),
            pytrace=False,
        )


def test_no_function_over_the_limit() -> None:
    offenders = sorted(
        (f for f in _all_functions() if f.lines > MAX_FUNCTION_LINES and f.key not in EXEMPT),
        key=lambda f: (-f.lines, f.path, f.line),
    )
    if offenders:
        pytest.fail(
            f"{len(offenders)} function(s) in services/ over {MAX_FUNCTION_LINES} lines; split each by step:\n"
            + "\n".join(f"  {f.path}:{f.line} {f.qualname}: {f.lines} lines" for f in offenders),
            pytrace=False,
        )


def test_every_exemption_is_still_needed() -> None:
    functions = {f.key: f.lines for f in _all_functions()}
    modules = {_rel(m): len(m.read_text().splitlines()) for m in _modules()}
    stale = [
        key for key in EXEMPT
        if functions.get(key, 0) <= MAX_FUNCTION_LINES and modules.get(key, 0) <= MAX_MODULE_LINES
    ]
    assert not stale, f"exemptions no longer needed (or naming nothing), remove them from EXEMPT: {stale}"
