"""Without root or `ip netns`, the namespace tests skip with the reason
(checked here without either)."""

from __future__ import annotations

import os
import shutil

import pytest

from . import harness


def test_not_root_or_no_ip_is_a_reason_to_skip(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert harness.netns_unavailable() == "network namespaces need root"
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert harness.netns_unavailable() == "iproute2's `ip` is not installed"
