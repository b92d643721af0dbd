"""The batch service's internal credential: what it sends (as a bearer
token) with every line so that gateways honour the line's batch headers
(services/gateway/batch_lines.py). Gateways hold only its SHA-256
(`batch.internal_key_sha256`); the raw secret comes from the environment
(`KVMESH_BATCH_INTERNAL_KEY`) or a file (`batch.internal_key_file`, on
Kubernetes a mounted Secret) and is read once at start-up, never stored.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Mapping

from services.common.batch_credential import credential_digest, read_key_file
from services.common.config import ConfigError
from services.common.config.batch import BatchConfig

__all__ = ["CREDENTIAL_ENV", "internal_credential"]

CREDENTIAL_ENV = "KVMESH_BATCH_INTERNAL_KEY"


def internal_credential(config: BatchConfig, environ: Mapping[str, str] = os.environ) -> str:
    """The raw credential, checked against `batch.internal_key_sha256` (or,
    that empty, the digest of `batch.internal_key_file`: services/common/
    batch_credential.py); ConfigError (naming the setting) when there is
    none or it differs."""
    raw = environ.get(CREDENTIAL_ENV, "").strip()
    where = CREDENTIAL_ENV
    if not raw and config.internal_key_file:
        where = f"batch.internal_key_file ({config.internal_key_file})"
        raw = read_key_file(config.internal_key_file)
    if not raw:
        raise ConfigError(f"config.batch.internal_key_file: the batch service needs its internal credential: "
                          f"set {CREDENTIAL_ENV} or batch.internal_key_file")
    wanted = credential_digest(config)
    if not wanted:
        raise ConfigError("config.batch.internal_key_sha256: required by the batch service (and by the "
                          "gateways, which honour batch lines only with it): `kvmesh key hash KEY`, or "
                          "batch.internal_key_file on both sides")
    if not hmac.compare_digest(hashlib.sha256(raw.encode()).hexdigest(), wanted):
        raise ConfigError(f"config.batch.internal_key_sha256: the credential from {where} does not match it")
    return raw
