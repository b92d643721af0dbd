"""The checked-in stubs and Envoy descriptor set are exactly what
`make protos` produces from protos/ now."""

from __future__ import annotations

import filecmp
from pathlib import Path

from services.tools import protogen


def _files(root: Path) -> dict[str, Path]:
    return {str(p.relative_to(root)): p for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts}


def test_generated_code_is_current(tmp_path: Path) -> None:
    out = tmp_path / "proto"
    descriptor = tmp_path / "kvmesh.pb"
    protogen.generate(out, descriptor)

    fresh, checked_in = _files(out), _files(protogen.STUB_DIR)
    assert sorted(fresh) == sorted(checked_in), "run `make protos`: the stub files differ"
    stale = [name for name in fresh if not filecmp.cmp(fresh[name], checked_in[name], shallow=False)]
    assert not stale, f"run `make protos`: stale generated files {stale}"
    assert descriptor.read_bytes() == protogen.DESCRIPTOR.read_bytes(), (
        "run `make protos`: envoy/kvmesh.pb is stale"
    )
