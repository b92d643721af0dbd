"""Pinning vLLM's own processes (services/engine/vllm_backend/affinity.py),
on real child processes named the way vLLM names its own."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

from services.common.affinity import parse_cpus, pin_vllm_processes, vllm_processes

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux only")


@pytest.mark.parametrize(("spec", "cpus"), [("1", {1}), ("0-3", {0, 1, 2, 3}), ("0,2-3", {0, 2, 3}),
                                            (" 1 , 3 ", {1, 3})])
def test_core_lists_parse(spec: str, cpus: set[int]) -> None:
    assert parse_cpus(spec) == cpus


@pytest.mark.parametrize("spec", ["", "auto", "1-x", ","])
def test_what_is_not_a_core_list_is_refused(spec: str) -> None:
    with pytest.raises(ValueError):
        parse_cpus(spec)


def _sleeper(*title: str) -> subprocess.Popen[bytes]:
    """A child whose command line carries `title`, as vLLM's setproctitle does."""
    return subprocess.Popen([sys.executable, "-c", "import sys, time; sys.stdin.read()", *title],
                            stdin=subprocess.PIPE)


@pytest.fixture
def children() -> Iterator[list[subprocess.Popen[bytes]]]:
    procs = [_sleeper("VLLM::EngineCore"), _sleeper("VLLM::Worker"), _sleeper("envoy")]
    try:
        yield procs
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def test_only_vllm_processes_are_found_and_pinned(children: list[subprocess.Popen[bytes]]) -> None:
    core, worker, other = children
    assert vllm_processes(os.getpid()) == sorted([core.pid, worker.pid])
    mine = os.sched_getaffinity(0)
    target = {min(mine)}
    result = pin_vllm_processes(os.getpid(), target)
    assert set(result.pids) == {core.pid, worker.pid} and result.threads >= 2
    assert os.sched_getaffinity(core.pid) == target
    assert os.sched_getaffinity(worker.pid) == target
    assert os.sched_getaffinity(other.pid) == mine  # not vLLM's: left alone
    assert os.sched_getaffinity(0) == mine          # nor the caller
