"""Each test's tier, by its folder under tests/ (the markers are described in
pyproject.toml): `make check` runs the `unit` tier alone. A module of a
slower folder that is as fast and needs no process says so with
`pytestmark = pytest.mark.unit` (e.g. the root-free rules of
tests/k8s_netns); tests/conftest.py marks every collected test."""

from __future__ import annotations

from pathlib import Path

__all__ = ["TESTS", "TIERS", "tier_of"]

TESTS = Path(__file__).resolve().parent
TIERS = {
    "unit": "unit",
    "integration": "integration",
    "fuzz": "fuzz",
    "deploy": "deploy",
    "observability": "observability",
    "netns": "netns",
    "k8s_netns": "netns",
    "vllm": "vllm",
    "e2e": "e2e",
}


def tier_of(path: Path, own: set[str]) -> str | None:
    """A test's tier: its folder's (None outside the folders of TIERS),
    or `unit` where its module says so (`own`: its markers)."""
    if "unit" in own:
        return "unit"
    parts = path.relative_to(TESTS).parts if TESTS in path.parents else ()
    return TIERS.get(parts[0]) if len(parts) > 1 else None
