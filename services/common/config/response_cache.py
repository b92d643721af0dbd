"""The gateway's response cache, under `gateway.response_cache` in the YAML
(services/gateway/response_cache/; README "Response cache"). Which keys use
it is per API key (`ApiKeyConfig.response_cache`, `share_response_cache`);
this block says where entries live and how long. Bounds are checked at load
by `check_response_cache` (called from validation.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .errors import ConfigError

__all__ = ["CACHE_MODES", "CACHE_STORES", "ResponseCacheConfig", "check_response_cache"]

# An API key's `response_cache`: off (default) | on (every cacheable request)
# | request (only requests sending `X-Kvmesh-Cache: on`).
CACHE_MODES = ("off", "on", "request")
CACHE_STORES = ("embedded", "redis")
_REDIS_SCHEMES = ("redis://", "rediss://", "unix://")


@dataclass
class ResponseCacheConfig:
    """Where a gateway keeps completed deterministic answers (temperature 0 or
    a fixed seed) to replay them without an engine. A cache failure never
    fails a request: it is a miss, counted as an error."""

    # false = no key uses the cache, whatever its `response_cache` says (a
    # switch for an incident). Default true: keys are off until configured.
    enabled: bool = True
    # "embedded": this gateway's own memory (replicas do not share it, a
    # restart empties it); "redis": one Redis at `redis_url` shared by every
    # gateway. One of CACHE_STORES.
    store: str = "embedded"
    # redis://host:port/db (rediss:// for TLS, unix:///path.sock); required
    # with store "redis". E.g. redis://127.0.0.1:6379/0.
    redis_url: str = ""
    # Embedded store: most bytes of entries kept at once; the least recently
    # used goes first. > 0. 256 MiB: ~100k answers of ~2 KiB.
    max_bytes: int = 256 * 1024 * 1024
    # How long an entry is served, in seconds from when it was stored (Redis:
    # SET EX). > 0. One hour: repeated questions (evals, retries, a page
    # reloading) come within minutes; a model update changes the key anyway.
    ttl_seconds: float = 3600.0
    # Largest entry stored (encoded events); larger answers are not cached.
    # > 0 and <= max_bytes. 1 MiB: a 100k-token answer with no logprobs.
    max_entry_bytes: int = 1024 * 1024
    # Redis: connect and per-operation bounds in seconds. > 0. 100 ms: a
    # loopback or LAN Redis answers in < 1 ms; a lookup must never cost a
    # request noticeable time.
    connect_timeout_seconds: float = 0.1
    op_timeout_seconds: float = 0.1
    # Redis circuit breaker: after this many failures in a row the gateway
    # stops asking Redis (every request a miss at no cost) for
    # `breaker_reset_seconds`, then tries one request again. >= 1 and > 0.
    breaker_failures: int = 3
    breaker_reset_seconds: float = 5.0
    # Prefix of every Redis key (a Redis shared with other applications).
    key_prefix: str = "kvmesh:rc:"


def check_response_cache(path: str, config: ResponseCacheConfig) -> None:
    """The block's bounds; ConfigError names the setting."""
    def fail(name: str, problem: str) -> None:
        raise ConfigError(f"{path}.{name}: {problem}")

    if config.store not in CACHE_STORES:
        fail("store", f"must be one of {', '.join(CACHE_STORES)}, got {config.store!r}")
    if config.store == "redis" and not config.redis_url.startswith(_REDIS_SCHEMES):
        fail("redis_url", f"store is redis: expected redis://host:port/db, got {config.redis_url!r}")
    for name in ("max_bytes", "ttl_seconds", "max_entry_bytes", "connect_timeout_seconds",
                 "op_timeout_seconds", "breaker_reset_seconds", "breaker_failures"):
        value: Any = getattr(config, name)
        if not value > 0:
            fail(name, f"must be > 0, got {value}")
    if config.max_entry_bytes > config.max_bytes:
        fail("max_entry_bytes", f"must be <= max_bytes ({config.max_bytes}), got {config.max_entry_bytes}")


def check_cache_mode(path: str, mode: str) -> None:
    """An API key's `response_cache`."""
    if mode not in CACHE_MODES:
        raise ConfigError(f"{path}: must be one of {', '.join(CACHE_MODES)}, got {mode!r}")
