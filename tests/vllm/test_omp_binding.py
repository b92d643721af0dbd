"""VllmConfig.omp_threads_bind -> VLLM_CPU_OMP_THREADS_BIND (no vLLM needed)."""

from __future__ import annotations

import pytest

from services.common import affinity

pytestmark = pytest.mark.unit  # in-process, no vLLM: the fast tier (tests/conftest.py)


@pytest.mark.parametrize(
    ("cores", "setting", "spec"),
    [
        ({0, 1}, "all", "0-1"),
        ({0, 1}, "all-but-one", "1"),
        ({0, 1, 2, 3, 6, 7}, "all-but-one", "1-3,6-7"),
        ({0}, "all-but-one", "0"),  # one core: nothing to leave over
        ({0, 1}, "0-3", "0-3"),  # vLLM's own syntax passes through
    ],
)
def test_bind_spec(monkeypatch: pytest.MonkeyPatch, cores: set[int], setting: str, spec: str) -> None:
    monkeypatch.setattr(affinity.os, "sched_getaffinity", lambda _pid: cores)
    assert affinity.omp_bind_spec(setting) == spec
