"""Process environment vLLM-CPU needs, set before vLLM is imported.

vLLM reads these from the environment (its engine-core and worker processes
inherit them at start-up): OpenMP core binding, where caches and sockets go,
and no hub or usage-stats traffic.
"""

from __future__ import annotations

import hashlib
import os
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path

from services.common.affinity import omp_bind_spec

__all__ = ["IPC_PATH_MAX", "REPO_ROOT", "prepare_environment", "resolve_path", "socket_tmpdir"]

REPO_ROOT = Path(__file__).resolve().parents[3]
# vLLM's engine core and worker talk over ipc:// sockets it names
# <TMPDIR>/<uuid4>; a Unix socket's path holds at most 107 bytes
# (sizeof(sun_path) - 1). A clone in a deep directory, or a benchmark's run
# directory inside it, put TMPDIR past that and vLLM failed to start
# ("ipc path ... is longer than 107 characters").
IPC_PATH_MAX = 107
_IPC_NAME = len("/") + 36
_SHORT_ROOT = Path("/tmp")


def resolve_path(path: str) -> Path:
    """Config paths are relative to the repository root."""
    p = Path(path)
    return p if p.is_absolute() else REPO_ROOT / p


def socket_tmpdir(preferred: Path, short_root: Path = _SHORT_ROOT) -> Path:
    """`preferred` when vLLM's socket names fit under it, else a short
    directory of this user's under `short_root`, the same for the same
    `preferred` (an engine's restarts reuse it instead of leaving one each)."""
    if len(os.fsencode(preferred)) + _IPC_NAME <= IPC_PATH_MAX:
        return preferred
    digest = hashlib.sha256(os.fsencode(preferred)).hexdigest()[:16]
    short = short_root / f"kvmesh-ipc-{os.getuid()}-{digest}"
    short.mkdir(mode=0o700, exist_ok=True)
    info = short.lstat()
    # A predictable name in a shared directory: use it only if it is ours and private.
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or stat.S_IMODE(info.st_mode) != 0o700:
        return Path(tempfile.mkdtemp(prefix="kvmesh-ipc-", dir=short_root))
    return short


def prepare_environment(scratch: Path, omp_threads_bind: str) -> Callable[[], None]:
    """Point vLLM at `scratch` and bind its threads; returns a function that
    restores TMPDIR (the only setting that matters to the rest of a shared
    process, e.g. a test session, once vLLM's processes have started)."""
    for sub in ("cache", "inductor", "tmp"):
        (scratch / sub).mkdir(parents=True, exist_ok=True)
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = omp_bind_spec(omp_threads_bind)
    os.environ["VLLM_CACHE_ROOT"] = str(scratch / "cache")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(scratch / "inductor")
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    os.environ["VLLM_NO_USAGE_STATS"] = "1"
    os.environ["DO_NOT_TRACK"] = "1"
    # The KV size comes from VllmConfig.kv_cache_gib alone: vLLM's legacy
    # variable would silently override it.
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
    old_tmpdir = os.environ.get("TMPDIR")
    old_tempdir = tempfile.tempdir
    os.environ["TMPDIR"] = str(socket_tmpdir(scratch / "tmp"))
    tempfile.tempdir = None  # gettempdir() caches; make it re-read TMPDIR

    def restore() -> None:
        if old_tmpdir is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = old_tmpdir
        tempfile.tempdir = old_tempdir

    return restore
