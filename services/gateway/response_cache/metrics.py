"""The response cache's metrics, on the gateway's registry
(services/gateway/metrics.py), each labelled with its `store`."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

__all__ = ["CacheMetrics"]


class CacheMetrics:
    """One store's counters: `kvmesh_gateway_response_cache_*`."""

    def __init__(self, registry: CollectorRegistry, store: str) -> None:
        def counter(name: str, doc: str) -> Counter:
            return Counter(f"kvmesh_gateway_response_cache_{name}", doc, ["store"], registry=registry).labels(store)

        self.hits = counter("hits", "Requests answered from the response cache (no engine involved).")
        self.misses = counter("misses", "Cache lookups that found nothing (or failed): the request was generated.")
        self.stores = counter("stores", "Completed answers written to the response cache.")
        self.evictions = counter("evictions", "Entries the embedded store dropped to stay within max_bytes "
                                              "(expired entries not included).")
        self.errors = counter("errors", "Cache operations that failed or timed out, or were skipped while "
                                        "the circuit breaker is open; each was a miss, never a failed request.")
        self.bytes = Gauge("kvmesh_gateway_response_cache_bytes",
                           "Bytes of entries held (embedded) or written by this gateway and not yet expired "
                           "(redis).", ["store"], registry=registry).labels(store)
