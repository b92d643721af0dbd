"""The Responses API's store, under `responses` in the YAML
(services/gateway/responses_store.py; README "Responses API"). Bounds are
checked at load by `validation.py` (`check_responses`)."""

from __future__ import annotations

from dataclasses import dataclass

from .errors import ConfigError

__all__ = ["RESPONSES_STORES", "ResponsesConfig", "check_responses"]

RESPONSES_STORES = ("embedded", "redis")


@dataclass
class ResponsesConfig:
    """What the gateways keep of the responses created with `store: true`, so
    a later request can continue one with `previous_response_id`."""

    # "embedded": this gateway's own memory (one gateway; a restart keeps
    # nothing, replicas do not share it). "redis": the Redis the response
    # cache names (gateway.response_cache.redis_url and its breaker; its
    # own op_timeout_seconds below), seen by every gateway: behind several gateways a
    # continuation may reach any of them (issue 29: 4 of 10 turns got 404
    # with the embedded store behind two gateways). One of RESPONSES_STORES.
    store: str = "embedded"
    # How long a stored response can be continued or read, in seconds, from
    # when it was created (Redis: SET EX). > 0. One hour: an agent's turns
    # follow each other within seconds to minutes; a longer-lived
    # conversation resends its items.
    ttl_seconds: float = 3600.0
    # Store "redis": the bound on one call to Redis (and on connecting), in
    # seconds. > 0. Longer than the response cache's 0.1 s: a cache that
    # does not answer in time is a miss, a store that does not is a 503 to
    # a client continuing its conversation -- a second covers a loaded
    # Redis or gateway, and the breaker still spares later requests a dead
    # one's wait.
    op_timeout_seconds: float = 1.0
    # Most responses kept at once; the oldest goes first. >= 0 (0 = store
    # nothing: `store: true` is then refused with a 400). Embedded: for the
    # gateway. Redis: PER API KEY (each key's own list, trimmed oldest
    # first), so one key cannot push out another's conversations; the
    # total is bounded by Redis' `maxmemory` (every entry has a TTL, so a
    # `volatile-ttl` or `volatile-lru` policy may evict them first).
    max_entries: int = 10000
    # Most bytes (JSON of the input and output items) kept at once; the
    # oldest goes first. > 0. 64 MiB: 10,000 agent turns of ~6 KiB each.
    # Redis: the largest single entry (the total is Redis' maxmemory).
    max_bytes: int = 64 * 1024 * 1024
    # Prefix of every Redis key (a Redis shared with the response cache, or
    # with other applications).
    key_prefix: str = "kvmesh:resp:"


def check_responses(path: str, config: ResponsesConfig, redis_url: str) -> None:
    """The block's bounds; `redis_url` = gateway.response_cache.redis_url,
    which store "redis" uses. ConfigError names the setting."""
    if config.store not in RESPONSES_STORES:
        raise ConfigError(f"{path}.store: must be one of {', '.join(RESPONSES_STORES)}, got {config.store!r}")
    if config.store == "redis" and not redis_url:
        raise ConfigError(f"{path}.store: redis needs gateway.response_cache.redis_url (the Redis it shares "
                          "with the response cache), which is empty")
    if not config.op_timeout_seconds > 0:
        raise ConfigError(f"{path}.op_timeout_seconds: must be > 0, got {config.op_timeout_seconds}")
    if not config.key_prefix:
        raise ConfigError(f"{path}.key_prefix: must not be empty")
