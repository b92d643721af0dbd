"""One fuzz mesh (real processes on free ports, no Envoy) shared by the
fuzz tests (package scope: it stops after them, not at the session's end
-- idle, it still ran beside every later test), and the idle check after
them."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from _mesh_stop import stop_test_mesh

from services.launcher.mesh import Mesh

from .targets import MODEL, ROOT, start_fuzz_mesh


@pytest.fixture(scope="package")
def fuzz_mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    if not (ROOT / ".models" / MODEL).is_dir():
        pytest.skip(f".models/{MODEL} is missing: run `make setup`")
    mesh = start_fuzz_mesh(tmp_path_factory.mktemp("fuzz-mesh"))
    try:
        yield mesh
    finally:
        stop_test_mesh(mesh)
