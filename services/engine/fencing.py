"""The engine's side of lease fencing (services/scheduler/fencing.py): the
scheduler names generations this engine runs that it does not lease here
(`Fence` on the Connect stream); each is ended at once -- its backend stream
stops, which frees its KV blocks -- logged and counted
(`kvmesh_engine_fenced_total`).

A fenced generation is handed over, not cancelled: should a gateway still be
reading it, its stream ends UNAVAILABLE and the gateway migrates the request
from its next token (never a truncated answer), as when an engine stops.

Requests of the engine's own OpenAI endpoint (http_api.py, ids starting with
OWN_ENDPOINT_PREFIX) are never leased by the scheduler, so load reports leave
them out (`fenceable`): listed, each was fenced ~1-2 s after it started --
every request of another router (bench_peers' smg, sglang-router) whose
prompt and answer took longer ended early with finish_reason "abort"
(measured on the cache-pressure workload, 2026-12-02).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from services.engine.runtime import EngineRuntime

__all__ = ["OWN_ENDPOINT_PREFIX", "Fencer", "fenceable"]

log = logging.getLogger(__name__)

# Request ids of the engine's own OpenAI endpoint (http_api.py).
OWN_ENDPOINT_PREFIX = "http-"


def fenceable(request_ids: Sequence[str]) -> list[str]:
    """The ids a load report lists: not those of the engine's own endpoint."""
    return [r for r in request_ids if not r.startswith(OWN_ENDPOINT_PREFIX)]


class Fencer:
    def __init__(self, runtime: EngineRuntime, engine_id: str) -> None:
        self._runtime = runtime
        self._engine_id = engine_id
        self.fenced = 0
        self._counter = runtime.metrics.fenced.labels(engine_id)

    def apply(self, request_ids: Sequence[str]) -> int:
        """End the named generations that are live here; returns how many."""
        ended = []
        for request_id in request_ids:
            generation = self._runtime.generation(request_id)
            if generation is not None:
                generation.hand_over("fenced: the scheduler leases this request to another engine or to none")
                ended.append(request_id)
        if ended:
            self.fenced += len(ended)
            self._counter.inc(len(ended))
            log.warning("fenced %d generations the scheduler does not lease here: %s",
                        len(ended), ", ".join(ended[:10]) + (" ..." if len(ended) > 10 else ""))
        return len(ended)
