"""Each test's tier by its folder (tests/_tiers.py): what `make check`
(`-m unit`) selects, and that every tier is a declared marker."""

from __future__ import annotations

import tomllib
from types import ModuleType

import pytest

from tests._scripts import load_script
from tests._tiers import TESTS, TIERS, tier_of

ROOT = TESTS.parent


@pytest.mark.parametrize(("path", "want"), [
    ("unit/gateway/test_gateway_http.py", "unit"),
    ("unit/test_code_gates.py", "unit"),
    ("netns/test_netns_partitions.py", "netns"),
    ("k8s_netns/test_k8s_netns.py", "netns"),
    ("e2e/agent_api/test_agents_tools.py", "e2e"),
    ("vllm/test_vllm_backend.py", "vllm"),
    ("fuzz/test_fuzz_mesh.py", "fuzz"),
    ("deploy/test_render.py", "deploy"),
    ("observability/test_dashboards.py", "observability"),
    ("integration/test_aging.py", "integration"),
    ("test_at_the_top.py", None),  # no folder, no tier
])
def test_a_test_takes_its_folders_tier(path: str, want: str | None) -> None:
    assert tier_of(TESTS / path, set()) == want


def test_a_module_of_a_slow_folder_may_declare_itself_unit() -> None:
    assert tier_of(TESTS / "k8s_netns" / "test_kube_rules.py", {"unit", "timeout"}) == "unit"
    assert tier_of(TESTS / "e2e" / "test_e2e_vllm.py", {"vllm", "e2e"}) == "e2e"  # other marks change nothing


def test_outside_tests_there_is_no_tier() -> None:
    assert tier_of(ROOT / "services" / "gateway" / "http_api.py", set()) is None


def test_every_tier_folder_exists_and_every_tier_is_a_declared_marker() -> None:
    assert all((TESTS / folder).is_dir() for folder in TIERS)
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    declared = {m.split(":")[0] for m in config["tool"]["pytest"]["ini_options"]["markers"]}
    assert set(TIERS.values()) <= declared


def _run_tests() -> ModuleType:
    """scripts/run_tests.py, `make test`'s two runs (loaded by path: scripts/ is no package)."""
    return load_script("run_tests")


def test_make_test_runs_every_test_once_in_two_runs() -> None:
    """Run 1 takes the fast tiers on two workers, run 2 everything else:
    together every tier, no tier twice, and a user's -m narrows both."""
    runs = _run_tests()
    fast, slow = runs.tier_runs(["-x", "tests/e2e"])
    assert fast[:2] == ["-m", "(unit or deploy or observability)"] and "-n" in fast and fast[-2:] == ["-x", "tests/e2e"]
    assert slow == ["-m", "not (unit or deploy or observability)", "-x", "tests/e2e"]
    declared = {line.split(":", 1)[0].strip().strip('"') for line in
                tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["markers"]}
    in_fast = {tier for tier in set(TIERS.values()) if tier in runs.FAST_TIERS.split(" or ")}
    assert in_fast == {"unit", "deploy", "observability"} and in_fast < declared
    fast, slow = runs.tier_runs(["-m", "netns", "--junitxml=out/r.xml"])
    assert fast[:2] == ["-m", "(netns) and (unit or deploy or observability)"] and "--junitxml=out/r.fast.xml" in fast
    assert slow == ["-m", "(netns) and not (unit or deploy or observability)", "--junitxml=out/r.xml"]
    assert runs.split_args(["-mnot e2e", "-q"]) == ("not e2e", ["-q"])


def test_run_2s_lanes_split_it_by_the_vllm_tier_and_keep_its_arguments() -> None:
    """The two lanes of run 2 together select what run 2 selects, none twice,
    and each writes its own report."""
    runs = _run_tests()
    _, slow = runs.tier_runs(["-m", "e2e", "--junitxml=out/r.xml", "-x"])
    mesh, vllm = runs.lanes(slow)
    run2 = "(e2e) and not (unit or deploy or observability)"
    assert mesh == ["-m", f"({run2}) and not (vllm or vllm_lane)", "--junitxml=out/r.xml", "-x"]
    assert vllm == ["-m", f"({run2}) and (vllm or vllm_lane)", "--junitxml=out/r.vllm.xml", "-x"]


@pytest.mark.parametrize(("statuses", "want"), [
    ((0, 0), 0), ((0, 5), 0), ((5, 0), 0), ((5, 5), 5), ((1, 0), 1), ((0, 1), 1), ((5, 2), 2), ((1, 2), 1),
    ((5, 5, 5), 5), ((5, 5, 0), 0), ((0, 0, 1), 1), ((5, 3, 1), 3),
])
def test_make_tests_exit_status(statuses: tuple[int, ...], want: int) -> None:
    """'No tests' in one run is no failure when another ran some."""
    assert _run_tests().combined_exit(*statuses) == want
