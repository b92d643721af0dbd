"""`make test`: every test, in two pytest runs, each tier where it runs best.

    .venv/bin/python scripts/run_tests.py [pytest arguments...]

1. The tiers that need no mesh -- `unit`, `deploy`, `observability` -- on two
   pytest-xdist workers (a module's tests in one worker, its module fixtures
   made once), with mypy filling its cache beside them so the gate
   (tests/unit/test_code_gates.py) finds it warm: ~3 minutes of one core
   become ~1.5 minutes of two.
2. Everything else, one test at a time: the meshes, the vLLM engines, the
   namespace hosts and the fault tests keep the machine to themselves (they
   assert behaviour under faults with timing bounds, and two of them side by
   side on two cores would only measure each other).

The pytest arguments go to both runs. A `-m EXPR` given is combined with each
run's own tier expression, so `-m netns` runs the netns tests (in run 2) and
nothing in run 1. A run that selects no test (pytest's exit 5) is not a
failure when the other ran tests; the exit status is the first failing run's,
or 5 when neither selected anything. `--junitxml=PATH` writes run 1's report
beside run 2's, as PATH with `.fast` before its suffix.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

__all__ = ["FAST_TIERS", "combined_exit", "split_args", "tier_runs"]

ROOT = Path(__file__).resolve().parents[1]
# The tiers that start no service process, need no root and no vLLM
# (pyproject.toml's markers; tests/_tiers.py gives each test its tier).
FAST_TIERS = "unit or deploy or observability"
NO_TESTS = 5  # pytest's "no tests collected / all deselected"


def split_args(args: list[str]) -> tuple[str | None, list[str]]:
    """The user's `-m` expression (None if absent) and the other arguments."""
    marker: str | None = None
    rest: list[str] = []
    it = iter(args)
    for arg in it:
        if arg == "-m":
            marker = next(it, None)
        elif arg.startswith("-m") and not arg.startswith("--"):
            marker = arg[2:].lstrip("=")
        else:
            rest.append(arg)
    return marker, rest


def _junit_fast(arg: str) -> str:
    path = Path(arg.split("=", 1)[1])
    return f"--junitxml={path.with_name(path.stem + '.fast' + path.suffix)}"


def tier_runs(args: list[str]) -> tuple[list[str], list[str]]:
    """pytest's arguments for run 1 (the fast tiers, two workers) and run 2 (the rest)."""
    marker, rest = split_args(args)
    fast = f"({FAST_TIERS})" if marker is None else f"({marker}) and ({FAST_TIERS})"
    slow = f"not ({FAST_TIERS})" if marker is None else f"({marker}) and not ({FAST_TIERS})"
    fast_rest = [_junit_fast(a) if a.startswith("--junitxml=") else a for a in rest]
    return (["-m", fast, "-n", "2", "--dist", "loadfile", *fast_rest], ["-m", slow, *rest])


def combined_exit(first: int, second: int) -> int:
    """One status for both runs: the first failure; 'no tests' only when neither ran any."""
    if first == NO_TESTS and second == NO_TESTS:
        return NO_TESTS
    for status in (first, second):
        if status not in (0, NO_TESTS):
            return status
    return 0


def main(argv: list[str]) -> int:
    fast, slow = tier_runs(argv)
    pytest = [sys.executable, "-m", "pytest"]
    warm = subprocess.Popen([sys.executable, str(ROOT / "scripts" / "typecheck.py")], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        print(f"== run 1 of 2: pytest {' '.join(fast)}", flush=True)
        first = subprocess.call([*pytest, *fast], cwd=ROOT)
    finally:
        warm.wait()
    print(f"== run 2 of 2: pytest {' '.join(slow)}", flush=True)
    second = subprocess.call([*pytest, *slow], cwd=ROOT)
    status = combined_exit(first, second)
    print(f"== make test: run 1 (the {FAST_TIERS} tiers) exited {first}, run 2 (the rest) {second}: "
          f"{'passed' if status == 0 else f'exit {status}'}", flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
