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
  right after the volume that hid it (`hidden`);
- the venv's base interpreter may lie under a folder a pod's non-root user
  cannot enter (pyenv's under a 0700 /root): the process would then start
  the interpreter binary but miss its own library and standard library and
  fall back to the system's (another Python patch release, without the
  venv's dependency choices). `reach_interpreter` makes it reachable in the
  pod's own mount namespace, as the image's interpreter is.
"""

from __future__ import annotations

import shlex
import sys
from collections.abc import Iterable
from pathlib import Path

__all__ = ["RUN_BASE", "bind_back", "hidden", "needed_by_pods", "reach_interpreter", "under_mount"]

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


def reach_interpreter(base_prefix: Path, folder: Path, visible: Iterable[Path]) -> list[str]:
    """sh lines for a non-root pod's mount script (run as root, in the pod's
    mount namespace, before its volumes): if a folder above `base_prefix`
    is closed to other users, a world-readable tmpfs over that folder with
    `base_prefix` alone bound back into it, read-only (the rest of the
    folder -- root's home -- stays out of the pod's sight). [] if every
    folder above it is open, or if the tmpfs would hide one of `visible`
    (the paths the pod runs from)."""
    locked = next((p for p in reversed(base_prefix.parents) if not p.stat().st_mode & 0o001), None)
    if locked is None or any(p == locked or locked in p.parents for p in visible):
        return []
    keep, base = shlex.quote(str(folder / "interpreter")), shlex.quote(str(base_prefix))
    return [f"mkdir -p {keep} && mount --bind {base} {keep}",
            f"mount -t tmpfs -o mode=0755 tmpfs {shlex.quote(str(locked))}",
            f"mkdir -p {base} && mount --bind {keep} {base}",
            f"mount -o remount,bind,ro {base}"]
