"""Vendor JSON schemas for custom resources (deploy/schemas/) from their CRDs.

kubernetes-validate knows the Kubernetes API's own kinds, not custom
resources. This turns a CRD's published openAPIV3Schema into a JSON schema
checked the way an API server with strict field validation (kubectl's
default) would check an object: unknown fields are errors (the API server
prunes or, strictly, refuses them), every `x-kubernetes-int-or-string` field
takes an integer or a string, apiVersion and kind are fixed. Descriptions and
the CEL rules (x-kubernetes-validations, needing a CEL engine) are dropped.

    python tests/deploy/crd_schemas.py --source "REPO@COMMIT" CRD.yaml... --out deploy/schemas
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import yaml

_DROP = {"description", "x-kubernetes-validations", "x-kubernetes-list-type", "x-kubernetes-list-map-keys",
         "x-kubernetes-map-type", "example", "format"}


def strict(node: dict[str, Any]) -> dict[str, Any]:
    """One schema node, converted (recursively)."""
    out = {k: v for k, v in node.items() if k not in _DROP}
    if out.pop("x-kubernetes-int-or-string", False):
        out.pop("type", None)
        out = {"anyOf": [{"type": "integer"}, {"type": "string"}], **out}
    preserve = out.pop("x-kubernetes-preserve-unknown-fields", False)
    if "properties" in out:
        out["properties"] = {name: strict(sub) for name, sub in out["properties"].items()}
        if not preserve and "additionalProperties" not in out:
            out["additionalProperties"] = False
    if isinstance(out.get("additionalProperties"), dict):
        out["additionalProperties"] = strict(out["additionalProperties"])
    if isinstance(out.get("items"), dict):
        out["items"] = strict(out["items"])
    for key in ("anyOf", "allOf", "oneOf"):
        if key in out:
            out[key] = [strict(sub) for sub in out[key]]
    return out


def from_crd(crd: dict[str, Any], source: str) -> dict[str, tuple[str, dict[str, Any]]]:
    """{file name: (kind, schema)} for each served version of the CRD."""
    spec = crd["spec"]
    group, kind = spec["group"], spec["names"]["kind"]
    out = {}
    for version in spec["versions"]:
        if not version.get("served"):
            continue
        api_version = f"{group}/{version['name']}"
        schema = strict(version["schema"]["openAPIV3Schema"])
        props = schema.setdefault("properties", {})
        props["apiVersion"] = {"const": api_version}
        props["kind"] = {"const": kind}
        props["metadata"] = {"type": "object"}
        schema["required"] = sorted({"apiVersion", "kind", "metadata", *schema.get("required", [])})
        schema = {"$schema": "https://json-schema.org/draft/2020-12/schema",
                  "$comment": f"{kind} {api_version} from {source}, converted by tests/deploy/crd_schemas.py",
                  **schema}
        out[f"{kind.lower()}-{group.split('.')[0]}-{version['name']}.json"] = (kind, schema)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("crds", nargs="+", type=Path)
    parser.add_argument("--source", required=True, help="where the CRDs came from (repository@commit)")
    parser.add_argument("--out", type=Path, default=Path("deploy/schemas"))
    ns = parser.parse_args(argv)
    ns.out.mkdir(parents=True, exist_ok=True)
    for path in ns.crds:
        for crd in yaml.safe_load_all(path.read_text()):
            if not crd or crd.get("kind") != "CustomResourceDefinition":
                continue
            for name, (_, schema) in from_crd(crd, f"{ns.source} {path.name}").items():
                (ns.out / name).write_text(json.dumps(schema, indent=1, sort_keys=True) + "\n")
                print(f"wrote {ns.out / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
