"""Generate the Python stubs and Envoy's descriptor set from protos/.

Run as `make protos` (python -m services.tools.protogen). A test runs it into
a temporary folder and fails when the checked-in output differs.

protoc writes absolute imports (`from kvmesh.v1 import common_pb2`); we rewrite
them to the package the stubs live in, so nothing has to touch sys.path.
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
import tempfile
from importlib import resources
from pathlib import Path

from grpc_tools import protoc

__all__ = ["generate", "main"]

ROOT = Path(__file__).resolve().parents[2]
PROTO_ROOT = ROOT / "protos"
STUB_DIR = ROOT / "services" / "common" / "proto"
DESCRIPTOR = ROOT / "envoy" / "kvmesh.pb"
STUB_PACKAGE = "services.common.proto"


def _include_dirs() -> list[str]:
    """grpc_tools ships google/protobuf; googleapis-common-protos ships google/api."""
    well_known = str(resources.files("grpc_tools") / "_proto")
    import google.api.annotations_pb2 as annotations

    googleapis = str(Path(annotations.__file__).resolve().parents[2])
    return [str(PROTO_ROOT), well_known, googleapis]


def generate(stub_dir: Path, descriptor: Path) -> None:
    """Write *_pb2.py, *_pb2.pyi and *_pb2_grpc.py under stub_dir and the
    descriptor set (with imports, for Envoy's transcoder) at descriptor."""
    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in PROTO_ROOT.rglob("*.proto"))
    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "protoc",
            *[f"-I{d}" for d in _include_dirs()],
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            f"--descriptor_set_out={descriptor}",
            "--include_imports",
            *protos,
        ]
        descriptor.parent.mkdir(parents=True, exist_ok=True)
        if protoc.main(args) != 0:
            raise SystemExit("protoc failed")
        if stub_dir.exists():
            shutil.rmtree(stub_dir)
        for src in Path(tmp).rglob("*.py*"):
            dest = stub_dir / src.relative_to(tmp)
            dest.parent.mkdir(parents=True, exist_ok=True)
            text = re.sub(r"^from kvmesh\.v1 import", f"from {STUB_PACKAGE}.kvmesh.v1 import",
                          src.read_text(), flags=re.M)
            text = re.sub(r"^import kvmesh\.v1\.", f"import {STUB_PACKAGE}.kvmesh.v1.", text, flags=re.M)
            dest.write_text(text)
    for pkg in [stub_dir, *[p for p in stub_dir.rglob("*") if p.is_dir()]]:
        (pkg / "__init__.py").touch()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=STUB_DIR)
    parser.add_argument("--descriptor", type=Path, default=DESCRIPTOR)
    ns = parser.parse_args(argv)
    generate(ns.out, ns.descriptor)
    return 0


if __name__ == "__main__":
    sys.exit(main())
