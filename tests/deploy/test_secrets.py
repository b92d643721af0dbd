"""scripts/k8s_secrets.sh: the Secrets the pods mount, made offline from the
development mesh CA -- every file a pod's volume picks exists, each role's
certificate loads as that role's mesh identity, the CA's key and the
operator's admin key stay out, the API key file loads as the gateway reads
it, the admin key file as the scheduler does, and the operator's config
finds the admin certificate."""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from services.common.config import GatewayConfig, SchedulerConfig, load_config
from services.common.mesh_tls import ROLES, MeshIdentity, identity_for
from services.gateway.keys import load_api_keys_file
from services.scheduler.admin_api import load_admin_keys_file

from .manifests import OVERLAYS, ROOT, render
from .wiring import NO_MESH_TLS, pods

SCRIPT = ROOT / "scripts" / "k8s_secrets.sh"


def _run(out: Path, key: str, admin_token: str = "kvma-test") -> dict[str, Any]:
    env = {**os.environ, "KVMESH_API_KEY": key, "KVMESH_ADMIN_TOKEN": admin_token, "PYTHON": sys.executable}
    subprocess.run(["bash", str(SCRIPT), "--out", str(out)], env=env, check=True, capture_output=True,
                   timeout=120, cwd=ROOT)
    docs = [d for d in yaml.safe_load_all((out / "secrets.yaml").read_text()) if d]
    return {f"{d['kind']}/{d['metadata']['name']}": d for d in docs}


def test_the_secrets_hold_what_the_pods_mount(tmp_path: Path) -> None:
    objects = _run(tmp_path / "s", "sk-test")
    assert set(objects) == {"Namespace/kvmesh", "Secret/kvmesh-mesh-tls", "Secret/kvmesh-api-keys",
                            "Secret/kvmesh-admin-keys", "Secret/kvmesh-batch-key"}
    tls = {k: base64.b64decode(v) for k, v in objects["Secret/kvmesh-mesh-tls"]["data"].items()}
    pod_roles = [r for r in ROLES if r != "admin"]
    assert set(tls) == {"ca.pem", *(f"{r}.pem" for r in pod_roles), *(f"{r}-key.pem" for r in pod_roles)}
    assert "ca-key.pem" not in tls and "admin-key.pem" not in tls   # the operator's pair stays local
    for overlay in OVERLAYS:
        if overlay.endswith("cert-manager"):
            continue  # its pods mount cert-manager's Secrets instead
        for pod in pods(render(overlay)):
            if pod.component in NO_MESH_TLS:
                assert not any(v["name"] == "mesh-tls" for v in pod.spec["volumes"]), (overlay, pod.name)
                continue
            vol = next(v for v in pod.spec["volumes"] if v["name"] == "mesh-tls")
            assert vol["secret"]["secretName"] == "kvmesh-mesh-tls"
            folder = tmp_path / overlay.replace("/", "-") / pod.component
            folder.mkdir(parents=True)
            for item in vol["secret"]["items"]:
                assert item["key"] in tls, (overlay, pod.name, item["key"])
                (folder / item["path"]).write_bytes(tls[item["key"]])
            if pod.component in ROLES:
                MeshIdentity.load(folder, pod.component)  # ca + this role's pair, nothing else
    keys_file = tmp_path / "api-keys.yaml"
    keys_file.write_bytes(base64.b64decode(objects["Secret/kvmesh-api-keys"]["data"]["api-keys.yaml"]))
    keys = load_api_keys_file(dataclasses.replace(GatewayConfig(), api_keys_file=str(keys_file)))
    assert [k.sha256 for k in keys] == [hashlib.sha256(b"sk-test").hexdigest()]
    _check_admin(tmp_path, objects)
    _check_batch_key(tmp_path, objects)
    rendered = subprocess.run(["kubectl", "kustomize", str(tmp_path / "s")], check=True, capture_output=True,
                              text=True, timeout=60).stdout
    assert "kvmesh-mesh-tls" in rendered


def test_a_second_run_keeps_the_ca(tmp_path: Path) -> None:
    first = _run(tmp_path, "a")
    again = _run(tmp_path, "b")
    assert again["Secret/kvmesh-mesh-tls"]["data"]["ca.pem"] == first["Secret/kvmesh-mesh-tls"]["data"]["ca.pem"]
    # The batch credential too: gateways and the batch pod keep agreeing across runs.
    assert again["Secret/kvmesh-batch-key"]["data"] == first["Secret/kvmesh-batch-key"]["data"]
    assert (tmp_path / "secrets.yaml").stat().st_mode & 0o077 == 0


def _check_admin(tmp_path: Path, objects: dict[str, Any]) -> None:
    """The scheduler's admin key file holds the token's SHA-256 (only); the
    operator's config reaches the scheduler with the admin certificate."""
    data = base64.b64decode(objects["Secret/kvmesh-admin-keys"]["data"]["admin-keys.yaml"])
    assert b"kvma-test" not in data
    keys_file = tmp_path / "admin-keys.yaml"
    keys_file.write_bytes(data)
    keys = load_admin_keys_file(dataclasses.replace(SchedulerConfig(), admin_keys_file=str(keys_file)))
    assert [(k.sha256, k.name) for k in keys] == [(hashlib.sha256(b"kvma-test").hexdigest(), "operator")]
    assert (tmp_path / "s" / "admin-token").read_text().strip() == "kvma-test"
    operator = load_config(tmp_path / "s" / "operator.yaml")
    assert (operator.scheduler.host, operator.scheduler.port) == ("127.0.0.1", 50051)
    identity = identity_for(operator, "admin")   # loads: ca.pem, admin.pem, admin-key.pem all there
    assert identity is not None and identity.cert_file == (tmp_path / "s" / "mesh-tls" / "admin.pem").resolve()


def _check_batch_key(tmp_path: Path, objects: dict[str, Any]) -> None:
    """The batch credential: random, long, the same in the Secret and the
    folder's copy, and exactly the key the batch pod and gateways mount."""
    data = objects["Secret/kvmesh-batch-key"]["data"]
    assert set(data) == {"internal-key"}
    key = base64.b64decode(data["internal-key"]).decode()
    assert key.startswith("kvmb-") and len(key) >= 40 and key.strip() == key
    assert (tmp_path / "s" / "batch-internal-key").read_text() == key
    assert (tmp_path / "s" / "batch-internal-key").stat().st_mode & 0o077 == 0
    for overlay in OVERLAYS:
        for pod in pods(render(overlay)):
            vol = next((v for v in pod.spec["volumes"] if v["name"] == "batch-key"), None)
            if pod.component in ("batch", "gateway"):
                assert vol is not None and vol["secret"]["secretName"] == "kvmesh-batch-key", (overlay, pod.name)
                assert {i["key"] for i in vol["secret"]["items"]} <= set(data), (overlay, pod.name)
            else:
                assert vol is None, f"{overlay}: {pod.name} holds the batch credential"
