"""`make test`: every test, in two pytest runs, each tier where it runs best.

    .venv/bin/python scripts/run_tests.py [pytest arguments...]

1. The tiers that need no mesh -- `unit`, `deploy`, `observability` -- on two
   pytest-xdist workers (a module's tests in one worker, its module fixtures
   made once), with mypy filling its cache beside them so the gate
   (tests/unit/test_code_gates.py) finds it warm: ~3 minutes of one core
   become ~1.5 minutes of two.
2. Everything else, in two lanes side by side, each one test at a time:
   the `vllm` tier (the real vLLM engines: three shared meshes and the
   in-process backend tests) and the rest (sim meshes, namespace hosts,
   fuzzing). One lane alone left a core idle most of the time: the sim-mesh
   tests mostly wait on the clock (streams, drains, deadlines, partitions)
   while a vLLM lane is mostly a core's work (boots, decode), and together
   they took 25 minutes one after the other. Every test asserts behaviour,
   not speed (bounds derived from what the machine measures, generous
   timeouts), so a neighbour lane only makes it slower, never wrong. The
   vLLM lane's output goes to `.run/test-vllm-lane.log` and is printed when
   both lanes are done.

The pytest arguments go to both runs. A `-m EXPR` given is combined with each
run's own tier expression, so `-m netns` runs the netns tests (in run 2) and
nothing in run 1. A run that selects no test (pytest's exit 5) is not a
failure when another ran tests; the exit status is the first failing run's,
or 5 when none selected anything. `--junitxml=PATH` writes run 1's report
and the vLLM lane's beside the other lane's, as PATH with `.fast` / `.vllm`
before its suffix.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

__all__ = ["FAST_TIERS", "VLLM_TIER", "combined_exit", "lanes", "split_args", "tier_runs"]

ROOT = Path(__file__).resolve().parents[1]
# The tiers that start no service process, need no root and no vLLM
# (pyproject.toml's markers; tests/_tiers.py gives each test its tier).
FAST_TIERS = "unit or deploy or observability"
VLLM_TIER = "vllm"  # run 2's second lane
# ...which also takes the tests marked `vllm_lane` (no vLLM needed): moved
# there so the lanes end together (pyproject.toml's markers).
VLLM_LANE = f"({VLLM_TIER} or vllm_lane)"
NO_TESTS = 5  # pytest's "no tests collected / all deselected"
VLLM_LOG = ROOT / ".run" / "test-vllm-lane.log"


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


def _junit_beside(arg: str, tag: str) -> str:
    path = Path(arg.split("=", 1)[1])
    return f"--junitxml={path.with_name(path.stem + '.' + tag + path.suffix)}"


def tier_runs(args: list[str]) -> tuple[list[str], list[str]]:
    """pytest's arguments for run 1 (the fast tiers, two workers) and run 2 (the rest)."""
    marker, rest = split_args(args)
    fast = f"({FAST_TIERS})" if marker is None else f"({marker}) and ({FAST_TIERS})"
    slow = f"not ({FAST_TIERS})" if marker is None else f"({marker}) and not ({FAST_TIERS})"
    fast_rest = [_junit_beside(a, "fast") if a.startswith("--junitxml=") else a for a in rest]
    return (["-m", fast, "-n", "2", "--dist", "loadfile", *fast_rest], ["-m", slow, *rest])


def lanes(slow: list[str]) -> tuple[list[str], list[str]]:
    """Run 2's arguments (`tier_runs`'s second) as its two lanes: every
    tier but `vllm`, and `vllm` (with the tests marked `vllm_lane`)."""
    marker, rest = split_args(slow)
    assert marker is not None  # tier_runs always sets run 2's
    vllm_rest = [_junit_beside(a, VLLM_TIER) if a.startswith("--junitxml=") else a for a in rest]
    return (["-m", f"({marker}) and not {VLLM_LANE}", *rest], ["-m", f"({marker}) and {VLLM_LANE}", *vllm_rest])


def combined_exit(*statuses: int) -> int:
    """One status for every run: the first failure; 'no tests' only when none ran any."""
    if all(status == NO_TESTS for status in statuses):
        return NO_TESTS
    for status in statuses:
        if status not in (0, NO_TESTS):
            return status
    return 0


def run_lanes(pytest: list[str], slow: list[str]) -> tuple[int, int]:
    """Run 2: both lanes at once; the vLLM lane's output printed after."""
    mesh, vllm = lanes(slow)
    VLLM_LOG.parent.mkdir(parents=True, exist_ok=True)
    print(f"== run 2 of 2, two lanes side by side:\n   pytest {' '.join(mesh)}\n   pytest {' '.join(vllm)}"
          f"  (output: {VLLM_LOG.relative_to(ROOT)}, printed below when done)", flush=True)
    with VLLM_LOG.open("w") as log:
        other = subprocess.Popen([*pytest, *vllm], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        try:
            first = subprocess.call([*pytest, *mesh], cwd=ROOT)
            second = other.wait()
        finally:
            if other.poll() is None:  # interrupted: end the lane we started
                other.terminate()
                other.wait()
    print(f"== run 2, the {VLLM_TIER} lane (exit {second}):", flush=True)
    print(VLLM_LOG.read_text(errors="replace"), flush=True)
    return first, second


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
    mesh, vllm = run_lanes(pytest, slow)
    status = combined_exit(first, mesh, vllm)
    print(f"== make test: run 1 (the {FAST_TIERS} tiers) exited {first}, run 2's lanes {mesh} (no vLLM) and "
          f"{vllm} ({VLLM_TIER}): {'passed' if status == 0 else f'exit {status}'}", flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
