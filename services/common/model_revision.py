"""A model's revision: `models[].revision` when configured, else a
fingerprint of the model directory. Engines send theirs in `EngineHello`
(`model_revision`, shown in GetState); the gateway's response cache keys
answers by the revision the serving engines report (its own fingerprint of
the same `models[].path` when none does).

The fingerprint is SHA-256 over, for every file under the directory (hidden
ones skipped, sorted by relative path): its path and size, the whole content
of files up to SMALL_FILE_BYTES (config.json, tokenizer and chat template,
generation_config.json, the safetensors index), and the first and last
EDGE_BYTES of larger ones (the weights: their headers list every tensor's
dtype, shape and offsets). Modification times are left out, so every
gateway computing it from its own copy of the same files agrees (Redis is
shared between them). Reading ~2 MiB per weight file keeps it fast at start.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

__all__ = ["EDGE_BYTES", "SMALL_FILE_BYTES", "model_revision"]

SMALL_FILE_BYTES = 4 * 1024 * 1024
EDGE_BYTES = 1024 * 1024


def model_revision(model_dir: Path, configured: str = "") -> str:
    """`configured` if set, else "sha256:<hex>" of the directory's files;
    a directory that cannot be read gives "unreadable:<path>" (its own
    revision, never shared with a readable one)."""
    if configured:
        return configured
    if not model_dir.is_dir():
        return f"unreadable:{model_dir}"
    digest = hashlib.sha256()
    try:
        files = sorted(p for p in model_dir.rglob("*") if p.is_file()
                       and not any(part.startswith(".") for part in p.relative_to(model_dir).parts))
        for path in files:
            size = path.stat().st_size
            digest.update(f"{path.relative_to(model_dir).as_posix()}\0{size}\0".encode())
            with path.open("rb") as handle:
                if size <= SMALL_FILE_BYTES:
                    digest.update(handle.read())
                else:
                    digest.update(handle.read(EDGE_BYTES))
                    handle.seek(size - EDGE_BYTES)
                    digest.update(handle.read(EDGE_BYTES))
    except OSError:
        return f"unreadable:{model_dir}"
    return f"sha256:{digest.hexdigest()}"
