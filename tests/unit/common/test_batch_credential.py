"""The internal credential's expected digest, as the batch service and the
gateways both derive it: the configured SHA-256, else that of the key file
both mount (Kubernetes: the Secret kvmesh-batch-key)."""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

import pytest

from services.batch.credential import CREDENTIAL_ENV, internal_credential
from services.common.batch_credential import credential_digest
from services.common.config import ConfigError
from services.common.config.batch import BatchConfig

KEY = "kvmb-unit-test-internal-key"
DIGEST = hashlib.sha256(KEY.encode()).hexdigest()


def test_the_configured_digest_wins_over_the_file(tmp_path: Path) -> None:
    other = tmp_path / "key"
    other.write_text("another key\n")
    config = BatchConfig(internal_key_sha256=DIGEST.upper(), internal_key_file=str(other))
    assert credential_digest(config) == DIGEST
    assert credential_digest(BatchConfig()) == ""


def test_the_key_file_alone_gives_both_sides_the_same_digest(tmp_path: Path) -> None:
    secret = tmp_path / "internal-key"
    secret.write_text(f"  {KEY}\n")
    config = BatchConfig(internal_key_file=str(secret))
    assert credential_digest(config) == DIGEST
    # The batch service starts with it, from the file or from the environment...
    assert internal_credential(config, {}) == KEY
    assert internal_credential(config, {CREDENTIAL_ENV: KEY}) == KEY
    # ...but not with a credential the gateways (reading the file) would refuse.
    with pytest.raises(ConfigError, match="does not match"):
        internal_credential(config, {CREDENTIAL_ENV: "kvmb-something-else"})


@pytest.mark.parametrize("content", [None, "", " \n"])
def test_a_missing_or_empty_key_file_is_a_config_error(tmp_path: Path, content: str | None) -> None:
    secret = tmp_path / "internal-key"
    if content is not None:
        secret.write_text(content)
    config = dataclasses.replace(BatchConfig(), internal_key_file=str(secret))
    with pytest.raises(ConfigError, match=r"batch\.internal_key_file"):
        credential_digest(config)
    with pytest.raises(ConfigError, match=r"batch\.internal_key_file"):
        internal_credential(config, {})
