"""One gateway's `ResponseCache` from its config: the store
`gateway.response_cache.store` names, its metrics on the gateway's registry,
and each configured model's directory and `revision` for its key."""

from __future__ import annotations

from pathlib import Path

from prometheus_client import CollectorRegistry

from services.common.clock import Clock, SystemClock
from services.common.config import MeshConfig
from services.common.config.response_cache import ResponseCacheConfig
from services.gateway.response_cache.cache import CacheStore, ResponseCache
from services.gateway.response_cache.embedded import EmbeddedStore
from services.gateway.response_cache.metrics import CacheMetrics

__all__ = ["build_response_cache", "disabled_cache"]


def build_response_cache(config: MeshConfig, registry: CollectorRegistry, clock: Clock,
                         model_dirs: dict[str, Path]) -> ResponseCache:
    """`model_dirs`: model name -> the directory its tokenizer was loaded from."""
    settings = config.gateway.response_cache
    metrics = CacheMetrics(registry, settings.store)
    store: CacheStore
    if settings.store == "redis":
        # Imported only when used: redis-py loads OpenTelemetry's API at import,
        # which a gateway with tracing off must not (tests/unit/common/test_tracing.py).
        from services.gateway.response_cache.redis_store import RedisStore
        store = RedisStore(settings, clock, metrics)
    else:
        store = EmbeddedStore(settings.max_bytes, settings.ttl_seconds, clock, metrics)
    dirs = {m.name: (model_dirs.get(m.name, Path(m.path)), m.revision) for m in config.models}
    return ResponseCache(settings, store, metrics, dirs, clock)


def disabled_cache() -> ResponseCache:
    """A cache that answers every lookup OFF (transports built without one)."""
    return ResponseCache(ResponseCacheConfig(enabled=False), None, None, {}, SystemClock())
