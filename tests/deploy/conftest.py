"""Skip (with the reason) only where kubectl is missing; it is on every
machine image, so a skip here is a broken machine, not a pass."""

from __future__ import annotations

import pytest

from .manifests import kubectl


@pytest.fixture(autouse=True)
def _needs_kubectl() -> None:
    if kubectl() is None:
        pytest.skip("kubectl is not installed: `kubectl kustomize` renders the manifests")
