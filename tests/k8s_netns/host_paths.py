"""Which of this machine's paths a pod still sees once its volumes are
mounted, and where the harness keeps its own files so that they stay seen.

A pod's volumes are mounted over their mountPath in the pod's own mount
namespace (cluster.py), and every pod of the overlays mounts an emptyDir
at /tmp: whatever of this machine lies under a mount path is hidden from
the pod. Two consequences, so that a clone anywhere (/tmp included) runs:

- the harness's volume folders (the sources of the pods' bind mounts) live
  under RUN_BASE, a fixed folder that no manifest mounts, never under the
  clone (whose place is the user's choice);
- the code and the venv the pods run from (`needed_by_pods`) may lie under
  a mount path: the pod's mount script binds each one back at its own path
  right after the volume that hid it (`hidden`).
"""

from __future__ import annotations

import shlex
import sys
from collections.abc import Iterable
from pathlib import Path

__all__ = ["RUN_BASE", "bind_back", "hidden", "needed_by_pods", "under_mount"]

# The harness's volume folders, one per run (pid): /var/lib is the machine's
# own state, no pod's volume (tests/k8s_netns/test_kube_rules.py checks the
# overlay). Not /tmp, not the clone.
RUN_BASE = Path("/var/lib/kvmesh-k8s-netns")


def under_mount(path: Path, mount_paths: Iterable[str]) -> str | None:
    """The deepest mount path `path` lies at or under (None: under none)."""
    covering = [m for m in mount_paths if Path(m) == path or Path(m) in path.parents]
    return max(covering, key=lambda m: len(Path(m).parts), default=None)


def needed_by_pods(root: Path) -> list[Path]:
    """This machine's paths a pod's process runs from: the checkout (cwd,
    PYTHONPATH, the models) and the venv (its python and the envoy binary),
    the venv once only when it lies inside the checkout."""
    venv = Path(sys.prefix)
    return [root] if venv == root or root in venv.parents else [root, venv]


def hidden(paths: Iterable[Path], mount_paths: Iterable[str]) -> dict[Path, str]:
    """Each of `paths` that a mount would hide -> the deepest mount path
    over it (so the path is bound back after that mount)."""
    mounts = list(mount_paths)
    out = {}
    for p in paths:
        if (m := under_mount(p, mounts)) is not None:
            out[p] = m
    return out


def bind_back(paths: Iterable[Path], mount_paths: Iterable[str], folder: Path,
              read_only: bool) -> tuple[list[str], dict[str, list[str]]]:
    """sh lines for a pod's mount script: those to run before its volumes
    are mounted (each hidden path bound to a folder `keep<j>` under
    `folder`, which no mount hides), and per mount path those to run right
    after it is mounted (the path bound back where it was; read-only with
    the image's read-only root)."""
    before: list[str] = []
    after: dict[str, list[str]] = {}
    for j, (path, mount) in enumerate(hidden(paths, mount_paths).items()):
        keep, back = shlex.quote(str(folder / f"keep{j}")), shlex.quote(str(path))
        before.append(f"mkdir -p {keep} && mount --bind {back} {keep}")
        after.setdefault(mount, []).append(f"mkdir -p {back} && mount --bind {keep} {back}")
        if read_only:
            after[mount].append(f"mount -o remount,bind,ro {back}")
    return before, after
