"""Shared test set-up: offline Hugging Face, each test's tier marker (by its
folder: _tiers.py), and `e2e_mesh`, a whole mesh (real processes, real Envoy) on
free ports, started once per test module."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from _mesh_stop import stop_test_mesh
from _tiers import tier_of

if TYPE_CHECKING:
    from services.launcher.mesh import Mesh

ROOT = Path(__file__).resolve().parents[1]

# Never reach for the hub: every model is a local directory.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        tier = tier_of(item.path, {m.name for m in item.iter_markers()})
        if tier is not None:
            item.add_marker(tier)


@pytest.fixture(scope="module")
def e2e_mesh(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    """Scheduler, two sim engines, gateways (one, or the test module's
    MESH_GATEWAYS) and Envoy, serving tiny-llama. A module may also set
    MESH_TOPOLOGY (an edge topology path relative to the repo root) and
    MESH_TUNE (a function changing the MeshConfig before start).

    The sim runs at half the default simulated GPU speed (a few ms per token):
    streams take visible time, so a test can leave mid-stream, yet whole
    answers still take well under a second.
    """
    from services.common.config import load_config  # keep collection light
    from services.launcher.mesh import MeshOptions, start_on_free_ports

    if not (ROOT / ".models" / "tiny-llama").is_dir():
        pytest.skip(".models/tiny-llama is missing: run `make setup`")
    config = load_config(ROOT / "config" / "kvmesh.yaml")
    config.engines.template.sim.speed_factor = 0.5
    topology = getattr(request.module, "MESH_TOPOLOGY", None)
    if topology:
        config.envoy.topology = topology
    tune = getattr(request.module, "MESH_TUNE", None)
    if tune is not None:
        tune(config)
    options = MeshOptions(
        engines=2, backend="sim", gateways=getattr(request.module, "MESH_GATEWAYS", 1), model="tiny-llama",
        free_ports=True,
        run_dir=tmp_path_factory.mktemp("mesh"),
    )
    mesh = start_on_free_ports(config, options)
    try:
        yield mesh
    finally:
        stop_test_mesh(mesh)
