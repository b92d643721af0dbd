"""Where the Kubernetes run keeps its files and what its pods still see
(host_paths.py; no root, no namespaces): the harness's volume folders lie
under no pod's mount path wherever the clone is, and a clone under a mount
path (/tmp) is bound back for the pod."""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

import pytest

from .cluster import Cluster
from .host_paths import RUN_BASE, bind_back, hidden, needed_by_pods, reach_interpreter, under_mount
from .kube import ROOT, Objects, pods, render

pytestmark = pytest.mark.unit

OVERLAY = ROOT / "deploy" / "overlays" / "dev-cpu"


@pytest.mark.parametrize(("path", "want"), [
    ("/tmp/kvm-clone/.run", "/tmp"),
    ("/tmp", "/tmp"),
    ("/tmpfoo/x", None),  # a sibling whose name starts alike is not under /tmp
    ("/etc/kvmesh/tls/ca.pem", "/etc/kvmesh/tls"),  # the deepest mount over it
    ("/var/lib/kvmesh-k8s-netns/k8s-netns-1", None),
])
def test_under_mount_is_by_path_components(path: str, want: str | None) -> None:
    assert under_mount(Path(path), ["/tmp", "/etc/kvmesh", "/etc/kvmesh/tls", "/models"]) == want


def test_the_volume_folders_are_not_derived_from_the_clone() -> None:
    factory = Cluster.__dataclass_fields__["vol_root"].default_factory
    assert callable(factory)
    vol_root = factory()
    assert RUN_BASE in vol_root.parents
    assert ROOT not in vol_root.parents
    assert under_mount(vol_root, ["/tmp"]) is None


def test_no_pod_of_the_overlay_mounts_over_the_volume_folders() -> None:
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed: `kubectl kustomize` renders the manifests")
    objects = Objects(render(OVERLAY))
    mounts = {m["mountPath"] for p in pods(objects) for c in p.spec["containers"] for m in c.get("volumeMounts") or ()}
    assert "/tmp" in mounts  # what made a clone under /tmp fail: the rule is tested against it
    assert under_mount(RUN_BASE, mounts) is None, sorted(mounts)


def test_a_clone_under_tmp_is_bound_back_after_tmp_is_mounted() -> None:
    clone, venv = Path("/tmp/kvm-clone"), Path("/tmp/venvs/kvm")
    assert hidden([clone, venv, Path("/work/main")], ["/tmp", "/models"]) == {clone: "/tmp", venv: "/tmp"}
    before, after = bind_back([clone, Path("/work/main")], ["/tmp", "/models"], Path("/var/lib/k/pod"),
                              read_only=True)
    assert before == ["mkdir -p /var/lib/k/pod/keep0 && mount --bind /tmp/kvm-clone /var/lib/k/pod/keep0"]
    assert after == {"/tmp": ["mkdir -p /tmp/kvm-clone && mount --bind /var/lib/k/pod/keep0 /tmp/kvm-clone",
                              "mount -o remount,bind,ro /tmp/kvm-clone"]}
    assert bind_back([Path("/work/main")], ["/tmp"], Path("/var/lib/k/pod"), read_only=False) == ([], {})


def test_the_pods_need_the_checkout_and_the_venv() -> None:
    needed = needed_by_pods(ROOT)
    assert needed[0] == ROOT
    assert any(p == Path(sys.prefix) or p in Path(sys.prefix).parents for p in needed)


def test_an_interpreter_under_a_closed_folder_is_made_reachable() -> None:
    """pyenv's interpreter under a 0700 home: a non-root pod reaches it
    through a tmpfs over the home with the interpreter alone bound back."""
    top = Path(tempfile.mkdtemp(dir="/var/tmp"))   # every folder above it open (pytest's tmp_path is not)
    try:
        top.chmod(0o755)
        closed = top / "home"
        base = closed / ".pyenv" / "versions" / "3.11.7"
        base.mkdir(parents=True)
        closed.chmod(0o700)
        keep = Path("/var/lib/k/pod")
        lines = reach_interpreter(base, keep, [Path("/work/main")])
        assert lines == [f"mkdir -p {keep}/interpreter && mount --bind {base} {keep}/interpreter",
                         f"mount -t tmpfs -o mode=0755 tmpfs {closed}",
                         f"mkdir -p {base} && mount --bind {keep}/interpreter {base}",
                         f"mount -o remount,bind,ro {base}"]
        assert reach_interpreter(base, keep, [closed / "checkout"]) == []   # the tmpfs would hide the code
        closed.chmod(0o755)
        assert reach_interpreter(base, keep, [Path("/work/main")]) == []
    finally:
        shutil.rmtree(top)
