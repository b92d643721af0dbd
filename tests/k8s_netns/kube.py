"""What kubelet would run, read from rendered manifests: pods of the
Deployments and the StatefulSet (names as Kubernetes makes them), each
container's argv and environment (downward API, Secret/ConfigMap refs,
Service links, `$(VAR)` expansion as Kubernetes does it), its volumes
written out as files (a StatefulSet's volumeClaimTemplates: one claim per
pod, `<template>-<pod>`), its probes and preStop hook; Services and
NetworkPolicies for DNS and firewall rules.

Nothing here starts anything: `cluster.py` runs these pods on namespace
hosts. The image's ENTRYPOINT `kvmesh` is `<venv python> -m services.cli`
(cwd = the repo root); Envoy's image runs the `envoy` binary on this machine.
"""

from __future__ import annotations

import base64
import hashlib
import os
import re
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from services.launcher.envoy_config import envoy_binary

__all__ = ["Container", "Objects", "Pod", "Volume", "expand", "kvmesh_argv", "render", "selects"]

ROOT = Path(__file__).resolve().parents[2]
NAMESPACE = "kvmesh"


def render(overlay: Path) -> list[dict[str, Any]]:
    """`kubectl kustomize overlay`: every object (bounded)."""
    proc = subprocess.run(["kubectl", "kustomize", str(overlay)], capture_output=True, text=True, timeout=120,
                          check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"kubectl kustomize {overlay} failed: {proc.stderr.strip()}")
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


def expand(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes' `$(VAR)` expansion (command, args, env values): `$(NAME)`
    of a defined variable becomes its value, `$$` becomes `$`, an undefined
    reference stays as written."""
    out, i = [], 0
    while i < len(text):
        if text[i] == "$" and i + 1 < len(text):
            nxt = text[i + 1]
            if nxt == "$":
                out.append("$")
                i += 2
                continue
            if nxt == "(":
                end = text.find(")", i + 2)
                if end != -1:
                    name = text[i + 2:end]
                    out.append(env[name] if name in env else text[i:end + 1])
                    i = end + 1
                    continue
        out.append(text[i])
        i += 1
    return "".join(out)


def selects(selector: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    """A LabelSelector (matchLabels + matchExpressions) against labels; {} selects all."""
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for expr in selector.get("matchExpressions") or ():
        key, op, values = expr["key"], expr["operator"], expr.get("values") or []
        ok = {"In": key in labels and labels[key] in values, "NotIn": labels.get(key) not in values,
              "Exists": key in labels, "DoesNotExist": key not in labels}[op]
        if not ok:
            return False
    return True


def kvmesh_argv(argv: Sequence[str]) -> list[str]:
    """An image command as this machine runs it: `kvmesh ...` is the repo's
    CLI under the venv's python, `envoy ...` the installed Envoy."""
    if argv and argv[0] == "kvmesh":
        return [sys.executable, "-m", "services.cli", *argv[1:]]
    if argv and argv[0] == "envoy":
        return [envoy_binary(), *argv[1:]]
    return list(argv)


@dataclass
class Objects:
    """The rendered objects by kind and name, plus Secrets made outside the
    manifests (the secrets script's)."""

    items: list[dict[str, Any]]
    secrets: dict[str, dict[str, bytes]] = field(default_factory=dict)

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [o for o in self.items if o.get("kind") == kind]

    def get(self, kind: str, name: str) -> dict[str, Any]:
        for o in self.of(kind):
            if o["metadata"]["name"] == name:
                return o
        raise KeyError(f"no {kind} {name} in the rendered objects")

    def config_map(self, name: str) -> dict[str, bytes]:
        cm = self.get("ConfigMap", name)
        data = {k: v.encode() for k, v in (cm.get("data") or {}).items()}
        data.update({k: base64.b64decode(v) for k, v in (cm.get("binaryData") or {}).items()})
        return data

    def secret(self, name: str) -> dict[str, bytes]:
        if name in self.secrets:
            return self.secrets[name]
        s = self.get("Secret", name)
        data = {k: base64.b64decode(v) for k, v in (s.get("data") or {}).items()}
        data.update({k: v.encode() for k, v in (s.get("stringData") or {}).items()})
        return data


@dataclass
class Volume:
    """One volumeMount: the files to put at `path` (a folder, or one file with subPath)."""

    path: str
    files: dict[str, bytes] | None = None  # ConfigMap/Secret items; None = a host folder
    host_dir: Path | None = None  # hostPath/PVC: this machine's folder
    claim: str = ""  # a StatefulSet's volumeClaimTemplates claim (<template>-<pod>): its own folder
    memory: bool = False  # emptyDir medium Memory -> tmpfs
    sub_path: str = ""
    mode: int = 0o644
    read_only: bool = False


@dataclass
class Container:
    name: str
    argv: list[str]
    env: dict[str, str]
    ports: dict[str, int]
    volumes: list[Volume]
    probes: dict[str, dict[str, Any]]
    pre_stop: list[str] | None
    # securityContext: runAsUser/runAsGroup/fsGroup (None = root), readOnlyRootFilesystem.
    user: int | None = None
    group: int | None = None
    fs_group: int | None = None
    read_only_root: bool = False


@dataclass
class Pod:
    """One pod of a workload: its name, labels, owner and its containers."""

    name: str
    workload: str  # Deployment/StatefulSet name
    component: str
    labels: dict[str, str]
    spec: dict[str, Any]
    grace_seconds: float
    # volume name -> PersistentVolumeClaim name, from a StatefulSet's volumeClaimTemplates.
    claims: dict[str, str] = field(default_factory=dict)

    def container(self, objects: Objects, ip: str, service_env: Mapping[str, str]) -> Container:
        """The (first) container as kubelet would start it on a pod with address `ip`."""
        c = self.spec["containers"][0]
        env = dict(service_env)
        env.update(self._env(objects, c, ip, env))
        command = [expand(a, env) for a in c.get("command") or ["kvmesh"]]
        args = [expand(a, env) for a in c.get("args") or []]
        ports = {p.get("name", str(p["containerPort"])): int(p["containerPort"]) for p in c.get("ports") or []}
        probes = {k: c[k] for k in ("startupProbe", "readinessProbe", "livenessProbe") if k in c}
        pre = ((c.get("lifecycle") or {}).get("preStop") or {}).get("exec", {}).get("command")
        pod_sc, sc = self.spec.get("securityContext") or {}, c.get("securityContext") or {}
        return Container(c["name"], kvmesh_argv([*command, *args]), env, ports,
                         self._volumes(objects, c), probes, list(pre) if pre else None,
                         user=sc.get("runAsUser", pod_sc.get("runAsUser")),
                         group=sc.get("runAsGroup", pod_sc.get("runAsGroup")),
                         fs_group=pod_sc.get("fsGroup"), read_only_root=bool(sc.get("readOnlyRootFilesystem")))

    def _env(self, objects: Objects, c: dict[str, Any], ip: str, base: dict[str, str]) -> dict[str, str]:
        fields = {"metadata.name": self.name, "metadata.namespace": NAMESPACE, "status.podIP": ip,
                  "status.hostIP": ip, "spec.nodeName": "node-" + self.name}
        env: dict[str, str] = {}
        for src in c.get("envFrom") or ():
            data = (objects.config_map(src["configMapRef"]["name"]) if "configMapRef" in src
                    else objects.secret(src["secretRef"]["name"]))
            env.update({src.get("prefix", "") + k: v.decode() for k, v in data.items()})
        for e in c.get("env") or ():
            ref = e.get("valueFrom")
            if ref is None:
                env[e["name"]] = expand(str(e.get("value", "")), {**base, **env})
            elif "fieldRef" in ref:
                env[e["name"]] = fields[ref["fieldRef"]["fieldPath"]]
            elif "secretKeyRef" in ref:
                env[e["name"]] = objects.secret(ref["secretKeyRef"]["name"])[ref["secretKeyRef"]["key"]].decode()
            elif "configMapKeyRef" in ref:
                r = ref["configMapKeyRef"]
                env[e["name"]] = objects.config_map(r["name"])[r["key"]].decode()
            else:
                raise ValueError(f"{self.name}: env {e['name']}: unsupported source {sorted(ref)}")
        return env

    def _volumes(self, objects: Objects, c: dict[str, Any]) -> list[Volume]:
        defs = {v["name"]: v for v in self.spec.get("volumes") or ()}
        out = []
        for m in c.get("volumeMounts") or ():
            vol = Volume(m["mountPath"], sub_path=m.get("subPath", ""), read_only=bool(m.get("readOnly")))
            if m["name"] not in defs and m["name"] in self.claims:
                vol.claim = self.claims[m["name"]]
                out.append(vol)
                continue
            v = defs[m["name"]]
            if "configMap" in v or "secret" in v:
                src = v.get("configMap") or v["secret"]
                data = (objects.config_map(src["name"]) if "configMap" in v
                        else objects.secret(src["secretName"]))
                items = src.get("items")
                vol.files = ({i["path"]: data[i["key"]] for i in items} if items else dict(data))
                vol.mode = int(src.get("defaultMode", 0o644))
            elif "emptyDir" in v:
                vol.memory = (v["emptyDir"] or {}).get("medium") == "Memory"
            elif "hostPath" in v or "persistentVolumeClaim" in v:
                # The models volume (hostPath/PVC in the overlays): this checkout's models.
                vol.host_dir = ROOT / ".models"
            else:
                raise ValueError(f"{self.name}: volume {m['name']}: unsupported kind {sorted(v)}")
            out.append(vol)
        return out


def _fake_hash(name: str) -> str:
    """A stable stand-in for a ReplicaSet's pod-template-hash (10 chars)."""
    alphabet = "bcdfghjklmnpqrstvwxz2456789"
    digest = hashlib.sha256(name.encode()).digest()
    return "".join(alphabet[b % len(alphabet)] for b in digest[:10])


def pods(objects: Objects) -> list[Pod]:
    """Every pod the Deployments and StatefulSets make, named like Kubernetes:
    `<statefulset>-<ordinal>`, `<deployment>-<hash>-<5 chars>`."""
    out = []
    for kind in ("Deployment", "StatefulSet"):
        for w in objects.of(kind):
            name, spec = w["metadata"]["name"], w["spec"]
            tmpl = spec["template"]
            labels = dict(tmpl["metadata"].get("labels") or {})
            grace = float(tmpl["spec"].get("terminationGracePeriodSeconds", 30))
            templates = [t["metadata"]["name"] for t in spec.get("volumeClaimTemplates") or ()]
            for i in range(int(spec.get("replicas", 1))):
                h = _fake_hash(name)
                pod = f"{name}-{i}" if kind == "StatefulSet" else f"{name}-{h[:9]}-{h[i % 5:][:4]}{i}"
                # The StatefulSet controller's claim names: <template>-<pod>, kept across the pod's restarts.
                out.append(Pod(pod, name, labels.get("app.kubernetes.io/component", name), labels,
                               tmpl["spec"], grace, {t: f"{t}-{pod}" for t in templates}))
    return out


def service_env(objects: Objects, addresses: Mapping[str, str]) -> dict[str, str]:
    """Kubernetes' Service-link variables (enableServiceLinks defaults to
    on): for each Service with a cluster IP, <NAME>_SERVICE_HOST/_PORT and the
    docker-link style <NAME>_PORT... ones. `addresses`: service name -> the
    address standing in for its cluster IP. Headless services get none."""
    env: dict[str, str] = {}
    for s in objects.of("Service"):
        name = s["metadata"]["name"]
        if s["spec"].get("clusterIP") == "None" or name not in addresses:
            continue
        prefix, ip = name.upper().replace("-", "_"), addresses[name]
        ports = s["spec"].get("ports") or []
        if not ports:
            continue
        env[f"{prefix}_SERVICE_HOST"] = ip
        env[f"{prefix}_SERVICE_PORT"] = str(ports[0]["port"])
        env[f"{prefix}_PORT"] = f"tcp://{ip}:{ports[0]['port']}"
        for p in ports:
            proto, port = p.get("protocol", "TCP"), p["port"]
            if "name" in p:
                env[f"{prefix}_SERVICE_PORT_{p['name'].upper().replace('-', '_')}"] = str(port)
            base = f"{prefix}_PORT_{port}_{proto}"
            env.update({base: f"{proto.lower()}://{ip}:{port}", f"{base}_PROTO": proto.lower(),
                        f"{base}_PORT": str(port), f"{base}_ADDR": ip})
    return env


def base_env() -> dict[str, str]:
    """What the image's environment gives every container here: PATH (the
    venv first, for `kvmesh`), no proxy, offline Hugging Face."""
    venv_bin = str(Path(sys.executable).parent)
    return {"PATH": f"{venv_bin}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "HOME": "/tmp", "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1", "LANG": os.environ.get("LANG", "C.UTF-8")}


def parse_args_flag(argv: Sequence[str], flag: str) -> str | None:
    """The value of `--flag V` or `--flag=V` in argv, None if absent."""
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def resolve_port(port: int | str, ports: Mapping[str, int]) -> int:
    """A probe's or policy's port: a number, or a container port's name."""
    if isinstance(port, int) or re.fullmatch(r"\d+", str(port)):
        return int(port)
    return ports[str(port)]
