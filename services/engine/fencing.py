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

Several scheduler replicas (README "Several schedulers"): the engine reports
to each, and each knows only its own leases. A generation carries the
replica that leased it (`GenerationRequest.scheduler_replica`, from the
gateway's engine request), and the engine consults only that replica's view:
- the load report to replica R lists (`listed_to`) the generations R leased,
  those of no known replica (one scheduler; a direct client), and those
  whose replica is gone (its Connect stream ended); the others are only
  counted (`others`: LoadReport.other_replica_generations);
- a `Fence` from R ends a generation R leased or one of no known replica. One
  whose replica is gone -- its gateway re-attaches the lease on another
  replica -- ends only once its replica has been gone for
  `fencing.startup_grace_seconds` (the time a restarted scheduler waits
  before fencing, for the same re-attachment) AND every replica connected
  now fenced it within a few confirm periods: the one that took it over
  never does.
With one scheduler every owner is that replica or "": today's rules.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

from services.common.config import FencingConfig
from services.engine.runtime import EngineRuntime

__all__ = ["OWN_ENDPOINT_PREFIX", "Fencer", "fenceable"]

log = logging.getLogger(__name__)

# Fences remembered for generations of gone replicas before ended ones are dropped.
_MAX_VOTES = 1024

# Request ids of the engine's own OpenAI endpoint (http_api.py).
OWN_ENDPOINT_PREFIX = "http-"


def fenceable(request_ids: Sequence[str]) -> list[str]:
    """The ids a load report lists: not those of the engine's own endpoint."""
    return [r for r in request_ids if not r.startswith(OWN_ENDPOINT_PREFIX)]


@dataclass
class _Replicas:
    """The scheduler replicas this engine is connected to now (a count per
    name: two links to one replica are possible while one reconnects), when
    each one that left went away, and the fences of generations whose
    replica is gone: request id -> {replica: when it fenced}."""

    connected: dict[str, int] = field(default_factory=dict)
    gone_since: dict[str, float] = field(default_factory=dict)
    votes: dict[str, dict[str, float]] = field(default_factory=dict)


class Fencer:
    def __init__(self, runtime: EngineRuntime, engine_id: str, config: FencingConfig | None = None) -> None:
        self._runtime = runtime
        self._engine_id = engine_id
        config = config or FencingConfig()
        self._orphan_grace = config.startup_grace_seconds
        # A replica fences a still-reported id again every confirm period:
        # a vote older than a few of them is stale.
        self._vote_seconds = 3 * config.confirm_seconds + 1.0
        self._replicas = _Replicas()
        self.fenced = 0
        self._counter = runtime.metrics.fenced.labels(engine_id)

    # ---------------------------------------------------------------- replicas

    def replica_up(self, replica: str) -> None:
        if replica:
            self._replicas.connected[replica] = self._replicas.connected.get(replica, 0) + 1
            self._replicas.gone_since.pop(replica, None)

    def replica_down(self, replica: str) -> None:
        count = self._replicas.connected.get(replica, 0) - 1
        if count > 0:
            self._replicas.connected[replica] = count
        elif replica in self._replicas.connected:
            del self._replicas.connected[replica]
            self._replicas.gone_since[replica] = self._runtime.clock.monotonic()

    def _owner(self, request_id: str) -> str:
        generation = self._runtime.generation(request_id)
        return generation.request.scheduler_replica if generation is not None else ""

    def _seen_by(self, owner: str, replica: str) -> bool:
        """Replica `replica` may judge a generation leased by `owner`."""
        return not owner or not replica or owner == replica or owner not in self._replicas.connected

    def listed_to(self, request_ids: Sequence[str], replica: str) -> tuple[list[str], int]:
        """(the ids the report to `replica` lists, how many others it only counts)."""
        if not self._replicas.connected:
            return list(request_ids), 0  # one scheduler not yet named: list all, as always
        listed = [r for r in request_ids if self._seen_by(self._owner(r), replica)]
        return listed, len(request_ids) - len(listed)

    def _may_end(self, request_id: str, owner: str, replica: str) -> bool:
        """Whether `replica`'s fence ends a live generation leased by `owner`."""
        if not owner or not replica or owner == replica:
            return True
        if owner in self._replicas.connected:
            return False  # its own replica leases it: only that one's fence counts
        now = self._runtime.clock.monotonic()
        if len(self._replicas.votes) > _MAX_VOTES:  # ids that ended meanwhile
            self._replicas.votes = {k: v for k, v in self._replicas.votes.items() if self._runtime.generation(k)}
        # A replica never connected here (its link came up later) counts as
        # gone from the first fence that names one of its generations.
        self._replicas.gone_since.setdefault(owner, now)
        votes = self._replicas.votes.setdefault(request_id, {})
        votes[replica] = now
        if now - self._replicas.gone_since[owner] < self._orphan_grace:
            return False
        return all(now - votes.get(r, -1e18) <= self._vote_seconds for r in self._replicas.connected)

    # ---------------------------------------------------------------- fences

    def apply(self, request_ids: Sequence[str], replica: str = "") -> int:
        """End the named generations that are live here and that `replica`
        (the fence's sender; "" = the one scheduler) may judge; returns how many."""
        ended = []
        for request_id in request_ids:
            generation = self._runtime.generation(request_id)
            if generation is None:
                self._replicas.votes.pop(request_id, None)
                continue
            if self._may_end(request_id, generation.request.scheduler_replica, replica):
                self._replicas.votes.pop(request_id, None)
                generation.hand_over("fenced: the scheduler leases this request to another engine or to none")
                ended.append(request_id)
        if ended:
            self.fenced += len(ended)
            self._counter.inc(len(ended))
            log.warning("fenced %d generations the scheduler does not lease here: %s",
                        len(ended), ", ".join(ended[:10]) + (" ..." if len(ended) > 10 else ""))
        return len(ended)
