"""The gateway's response cache: deterministic answers (temperature 0 or a
fixed seed) replayed without an engine. README "Response cache".

    policy.py       which requests may use it; what the headers ask
    key.py          the key: scope, model + revision, prompt tokens, sampling, output shape
    (services/common/model_revision.py: a model's revision, configured or its files' fingerprint;
     engines report theirs, cache.py keys by it)
    record.py       record a generation's events; encode, decode, replay
    embedded.py     the in-process store (LRU within max_bytes, TTL)
    redis_store.py  the shared store (Redis, SET EX) behind a circuit breaker (breaker.py)
    metrics.py      kvmesh_gateway_response_cache_* {store}
    cache.py        lookup + start: what the transports call
    build.py        the gateway's cache from its config
"""

from services.gateway.response_cache.build import build_response_cache, disabled_cache
from services.gateway.response_cache.cache import CacheStore, ResponseCache, Ticket
from services.gateway.response_cache.policy import CacheStatus

__all__ = ["CacheStatus", "CacheStore", "ResponseCache", "Ticket", "build_response_cache", "disabled_cache"]
