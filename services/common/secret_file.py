"""A secret kept in a file of its own (a token, a credential: on Kubernetes
a mounted Secret's key), read the one way every caller wants it: surrounding
whitespace dropped, and an unreadable or empty file a ConfigError that names
the setting pointing at it."""

from __future__ import annotations

from pathlib import Path

from services.common.config import ConfigError

__all__ = ["read_secret_file"]


def read_secret_file(path: str, setting: str) -> str:
    """The secret in `path`; ConfigError naming `setting` when it cannot be
    read or holds only whitespace."""
    try:
        secret = Path(path).read_text().strip()
    except OSError as exc:
        raise ConfigError(f"{setting}: cannot read {path}: {exc.strerror}") from exc
    if not secret:
        raise ConfigError(f"{setting}: {path} is empty")
    return secret
