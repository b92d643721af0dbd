"""API keys: who is calling, what they may use, at which priority.

Only SHA-256 digests of keys live in config (`kvmesh key hash KEY`), in
`gateway.api_keys` and in the file `gateway.api_keys_file` names (on
Kubernetes a mounted Secret), read once at start-up. A key
resolves to a `Principal`; with `auth_enabled: false` every caller is the
tenant "anonymous" with no limits and no ceiling.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from services.common.config import (
    ApiKeyConfig,
    GatewayConfig,
    api_key_digest,
)
from services.common.config.gateway import ApiKeysFile
from services.common.config.loader import load_side_file
from services.common.config.validation import check_api_keys
from services.gateway.errors import ErrorKind, GatewayError

__all__ = ["ANONYMOUS", "KeyStore", "Principal", "api_key_from_headers", "effective_priority",
           "load_api_keys_file"]

REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Principal:
    key_id: str                 # first 12 hex of the key's sha256: safe to log, limiter key
    tenant: str
    priority_ceiling: int       # best (lowest) class the key may use
    models: frozenset[str]      # empty = every model
    requests_per_second: float  # 0 = unlimited
    tokens_per_minute: float    # 0 = unlimited
    max_generation_seconds: float  # 0 = the gateway default


ANONYMOUS = Principal("anonymous", "anonymous", 0, frozenset(), 0.0, 0.0, 0.0)


def effective_priority(requested: int, principal: Principal) -> int:
    """A key allowed P1 asking for P0 gets P1 (lower number = more urgent)."""
    return max(requested, principal.priority_ceiling)


def api_key_from_headers(headers: Mapping[str, str]) -> str | None:
    """`Authorization: Bearer K` or `x-api-key: K` (HTTP headers or gRPC metadata)."""
    auth = headers.get("authorization") or headers.get("Authorization")
    if auth:
        scheme, _, value = auth.strip().partition(" ")
        if scheme.lower() == "bearer" and value.strip():
            return value.strip()
        return None
    key = headers.get("x-api-key") or headers.get("X-Api-Key")
    return key.strip() if key else None


class KeyStore:
    """Immutable after construction, so it is shared freely between tasks.
    Holds `api_keys` and those of `api_keys_file` (read here, once)."""

    def __init__(self, config: GatewayConfig) -> None:
        self.auth_enabled = config.auth_enabled
        self._by_digest = _index([*config.api_keys, *load_api_keys_file(config)])

    def authenticate(self, raw_key: str | None) -> Principal:
        if not self.auth_enabled:
            return ANONYMOUS
        if not raw_key:
            raise GatewayError(
                ErrorKind.UNAUTHENTICATED,
                "no API key: send 'Authorization: Bearer <key>' (HTTP) or 'authorization'/'x-api-key' metadata (gRPC)",
                code="missing_api_key",
            )
        principal = self._by_digest.get(hashlib.sha256(raw_key.encode()).hexdigest())
        if principal is None:
            raise GatewayError(
                ErrorKind.UNAUTHENTICATED, "invalid API key: check the key you send", code="invalid_api_key")
        return principal

    def principal_for(self, key_id: str) -> Principal | None:
        """The key with this id (a batch runs under its creator's key), or
        None when it is no longer configured; ANONYMOUS without auth."""
        if not self.auth_enabled:
            return ANONYMOUS
        return next((p for p in self._by_digest.values() if p.key_id == key_id), None)

    @staticmethod
    def check_model(principal: Principal, model: str) -> None:
        if principal.models and model not in principal.models:
            allowed = ", ".join(sorted(principal.models))
            raise GatewayError(
                ErrorKind.PERMISSION_DENIED,
                f"this API key may not use model {model!r}; it may use: {allowed}",
                param="model",
                code="model_not_allowed",
            )

    @staticmethod
    def allows(principal: Principal, model: str) -> bool:
        return not principal.models or model in principal.models


def load_api_keys_file(config: GatewayConfig) -> list[ApiKeyConfig]:
    """The keys of `gateway.api_keys_file` (none when unset), checked by the
    config's own rules and against `gateway.api_keys`; ConfigError names
    the file and the entry."""
    if not config.api_keys_file:
        return []
    path = REPO_ROOT / config.api_keys_file
    keys = load_side_file(ApiKeysFile, "gateway.api_keys_file", path).api_keys
    check_api_keys(keys, f"{path}: api_keys", {api_key_digest(k) for k in config.api_keys})
    return keys


def _index(keys: Sequence[ApiKeyConfig]) -> dict[str, Principal]:
    out: dict[str, Principal] = {}
    for key in keys:
        digest = api_key_digest(key)
        out[digest] = Principal(
            key_id=digest[:12],
            tenant=key.tenant,
            priority_ceiling=key.priority_ceiling,
            models=frozenset(key.models),
            requests_per_second=key.requests_per_second,
            tokens_per_minute=key.tokens_per_minute,
            max_generation_seconds=key.max_generation_seconds,
        )
    return out
