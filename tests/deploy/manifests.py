"""Rendering and schema-checking the Kubernetes manifests (deploy/).

    objects = render("overlays/dev-cpu")      # kubectl kustomize, parsed
    errors = schema_errors(objects, "1.32")   # [] when every object validates

Kubernetes' own kinds validate with PyPI kubernetes-validate (its bundled
API schemas, strict: unknown fields are errors); custom resources
(ServiceMonitor, PodMonitor, PrometheusRule, cert-manager's Certificate and
Issuer, KEDA's ScaledObject) with the schemas vendored in deploy/schemas/ (crd_schemas.py).
Other tests (tests/netns) may import `render` to start what the manifests say.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from functools import cache
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
SCHEMAS = DEPLOY / "schemas"
# Every kustomization an operator may apply (and the base they share).
OVERLAYS = ("base", "overlays/dev-cpu", "overlays/gpu", "overlays/monitoring", "overlays/cert-manager",
            "overlays/tracing", "overlays/autoscaling")
# The Kubernetes versions the manifests must be valid for: the oldest we
# support (kubectl on these machines is 1.32) and the newest
# kubernetes-validate 1.37.0 knows.
K8S_VERSIONS = ("1.32", "1.37")

Obj = dict[str, Any]


def kubectl() -> str | None:
    return shutil.which("kubectl")


def kustomize(folder: Path) -> list[Obj]:
    """`kubectl kustomize FOLDER`, offline, as parsed objects."""
    exe = kubectl()
    if exe is None:
        raise RuntimeError("kubectl not found")
    done = subprocess.run([exe, "kustomize", str(folder)], capture_output=True, text=True,
                          timeout=120, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"kubectl kustomize {folder} failed: {done.stderr.strip()}")
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


@cache
def _rendered(overlay: str) -> str:
    return json.dumps(kustomize(DEPLOY / overlay))


def render(overlay: str) -> list[Obj]:
    """The overlay's objects (a fresh copy each call: tests may mutate it)."""
    return list(json.loads(_rendered(overlay)))


def ident(obj: Obj) -> str:
    return f"{obj.get('kind')}/{obj.get('metadata', {}).get('name')}"


@cache
def _crd_schemas() -> dict[tuple[str, str], str]:
    """(apiVersion, kind) -> vendored schema file text."""
    out = {}
    for path in sorted(SCHEMAS.glob("*.json")):
        schema = json.loads(path.read_text())
        props = schema["properties"]
        out[(props["apiVersion"]["const"], props["kind"]["const"])] = path.read_text()
    return out


def schema_errors(objects: list[Obj], version: str) -> list[str]:
    """One line per object that does not validate (or has no schema)."""
    import jsonschema
    import kubernetes_validate

    errors = []
    for obj in objects:
        crd = _crd_schemas().get((obj.get("apiVersion", ""), obj.get("kind", "")))
        try:
            if crd is not None:
                jsonschema.Draft202012Validator(json.loads(crd)).validate(obj)
            else:
                kubernetes_validate.validate(obj, version, strict=True)
        except jsonschema.ValidationError as exc:
            where = "/".join(str(p) for p in exc.absolute_path)
            errors.append(f"{ident(obj)}: {where}: {exc.message}")
        except kubernetes_validate.ValidationError as exc:
            where = "/".join(str(p) for p in exc.path)
            errors.append(f"{ident(obj)}: {where}: {exc.message}")
        except kubernetes_validate.SchemaNotFoundError:
            errors.append(f"{ident(obj)}: no schema for {obj.get('apiVersion')} {obj.get('kind')} "
                          f"in Kubernetes {version} nor in deploy/schemas/")
    return errors
