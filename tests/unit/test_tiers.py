"""Each test's tier by its folder (tests/_tiers.py): what `make check`
(`-m unit`) selects, and that every tier is a declared marker."""

from __future__ import annotations

import tomllib

import pytest

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
