"""The batch service's internal credential as both of its sides read it:
the batch service sends it with every line, gateways honour a line's batch
headers only from a caller presenting it (services/batch/credential.py,
services/gateway/batch_lines.py).

Its expected SHA-256 is `batch.internal_key_sha256` when set, else the
digest of `batch.internal_key_file`'s content. The file form is for
Kubernetes: the ConfigMap every pod loads is in git and the same for every
install, while the credential is made per install (scripts/k8s_secrets.sh,
Secret kvmesh-batch-key) and mounted in the batch pod and every gateway pod,
so both sides derive the digest from the same Secret.
"""

from __future__ import annotations

import hashlib

from services.common.config.batch import BatchConfig
from services.common.secret_file import read_secret_file

__all__ = ["credential_digest", "read_key_file"]


def read_key_file(path: str) -> str:
    """The credential in `path` (surrounding whitespace dropped); ConfigError
    naming `batch.internal_key_file` when it cannot be read or is empty."""
    return read_secret_file(path, "config.batch.internal_key_file")


def credential_digest(config: BatchConfig) -> str:
    """The SHA-256 (hex, lower case) the credential must have; "" when
    neither `internal_key_sha256` nor `internal_key_file` is set (gateways
    then refuse every batch line, the batch service refuses to start)."""
    wanted = config.internal_key_sha256.strip().lower()
    if wanted or not config.internal_key_file:
        return wanted
    return hashlib.sha256(read_key_file(config.internal_key_file).encode()).hexdigest()
