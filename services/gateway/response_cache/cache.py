"""The response cache as both transports use it: `lookup` after admission
(the job's prompt tokens are known), then `start` instead of the driver's.

    ticket = await cache.lookup(job, request, principal, headers, resumed)
    stream = cache.start(ticket, job, driver)   # a hit never reaches the driver

A hit replays the stored events (record.py) in a plain `EventStream`: no
scheduler call, no engine. A miss (or a `no-cache` bypass) runs the driver
with a `Recorder`, which stores a complete answer in the background, so a
slow store never delays the client. Every store failure is counted
(`errors`) and is a miss; nothing here raises into a request.

State: the store, and the set of store tasks in flight, owned by the event
loop's thread (one `ResponseCache` per gateway, shared by both transports).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from services.common.clock import Clock
from services.common.config.response_cache import ResponseCacheConfig
from services.common.model_revision import model_revision
from services.common.openai_api.requests import GenerationInput
from services.gateway.driver import GenerationDriver
from services.gateway.event_stream import EventStream
from services.gateway.jobs import Job
from services.gateway.keys import Principal
from services.gateway.response_cache.key import cache_key, cache_scope
from services.gateway.response_cache.metrics import CacheMetrics
from services.gateway.response_cache.policy import CacheStatus, directive_for, uncacheable_reason
from services.gateway.response_cache.record import Recorded, Recorder, decode_entry, replay
from services.gateway.served_models import ServedModel

__all__ = ["CacheStore", "Fleet", "ResponseCache", "Ticket"]

log = logging.getLogger(__name__)

# The models served now, with the revisions their engines report (served_models.py).
Fleet = Callable[[], Awaitable[Mapping[str, ServedModel]]]


class CacheStore(Protocol):
    """Where entries live (embedded.py, redis_store.py). `get`/`put` may
    raise anything: the cache counts it as an error and a miss."""

    name: str

    async def get(self, key: str) -> bytes | None: ...
    async def put(self, key: str, value: bytes) -> None: ...
    async def aclose(self) -> None: ...


@dataclass(frozen=True)
class Ticket:
    """What the cache decided for one request."""

    status: CacheStatus
    key: str = ""
    write: bool = False                          # store the answer when complete
    events: tuple[Recorded, ...] | None = None   # a hit's entry

    @property
    def headers(self) -> dict[str, str]:
        """`X-Kvmesh-Cache: hit|miss|bypass` (HTTP header, gRPC initial
        metadata); none for a key that does not use the cache."""
        return {} if self.status is CacheStatus.OFF else {"X-Kvmesh-Cache": self.status.value}


OFF = Ticket(CacheStatus.OFF)


class ResponseCache:
    def __init__(self, config: ResponseCacheConfig, store: CacheStore | None, metrics: CacheMetrics | None,
                 model_dirs: Mapping[str, tuple[Path, str]], clock: Clock) -> None:
        self._config = config
        self._store = store   # None: no cache at all (every ticket OFF)
        self._metrics = metrics
        self._model_dirs = dict(model_dirs)   # model -> (directory, configured revision)
        self._revisions: dict[str, str] = {}
        self._clock = clock
        self._pending: set[asyncio.Task[None]] = set()
        self._fleet: Fleet | None = None

    def attach_fleet(self, fleet: Fleet) -> None:
        """Where the serving engines' revisions come from (the gateway's
        cached GetState view, shared with /v1/models)."""
        self._fleet = fleet

    @property
    def store(self) -> CacheStore | None:
        return self._store

    async def revision(self, model: str) -> str | None:
        """The revision answers for `model` are keyed by: the one its serving
        engines report (EngineHello.model_revision); None while they report
        several (a rollout: which one answers is unknown, so no entry is
        safe to read or write); without reports (no fleet view, engines that
        send none, the scheduler unreachable) this gateway's own fingerprint
        of the same model files."""
        if self._fleet is not None:
            try:
                served = (await self._fleet()).get(model)
            except Exception:  # noqa: BLE001 - no fleet view: the own fingerprint
                served = None
            if served is not None and served.revisions:
                return next(iter(served.revisions)) if len(served.revisions) == 1 else None
        return self._own_revision(model)

    def _own_revision(self, model: str) -> str:
        """This gateway's fingerprint of the model (model_revision.py), computed once."""
        found = self._revisions.get(model)
        if found is None:
            directory, configured = self._model_dirs.get(model, (Path("/nonexistent"), ""))
            found = self._revisions[model] = model_revision(directory, configured)
            log.info("response cache: model %s revision %s", model, found)
        return found

    async def lookup(self, job: Job, request: GenerationInput, principal: Principal,
                     headers: Mapping[str, str], resumed: bool = False) -> Ticket:
        """What the cache does for this request; never raises (but a
        cancellation): anything unexpected is counted and the cache is off."""
        if self._store is None or not self._config.enabled:
            return OFF
        try:
            return await self._lookup(job, request, principal, headers, resumed)
        except Exception:   # a cache failure never fails a request
            self._count("errors")
            log.exception("response cache: lookup failed; the request is generated")
            return OFF

    async def _lookup(self, job: Job, request: GenerationInput, principal: Principal,
                      headers: Mapping[str, str], resumed: bool) -> Ticket:
        directive = directive_for(principal.response_cache, headers)
        if directive is None:
            return OFF
        if uncacheable_reason(request, resumed) is not None:
            return Ticket(CacheStatus.BYPASS)
        revision = await self.revision(job.model)
        if revision is None:
            return Ticket(CacheStatus.BYPASS)
        scope = cache_scope(principal.tenant, principal.share_response_cache)
        key = cache_key(scope, revision, job, request)
        if not directive.read:
            return Ticket(CacheStatus.BYPASS, key, write=directive.write)
        events = await self._get(key)
        if events is not None:
            self._count("hits")
            return Ticket(CacheStatus.HIT, key, events=tuple(events))
        self._count("misses")
        return Ticket(CacheStatus.MISS, key, write=directive.write)

    def start(self, ticket: Ticket, job: Job, driver: GenerationDriver) -> EventStream:
        """The request's event stream: the entry replayed, or the driver's
        generation (recorded when the ticket says to store it)."""
        if ticket.events is not None:
            replayed = EventStream(replay(ticket.events), driver.settings.heartbeat_seconds, self._clock)
            replayed.resumable = False   # nothing on an engine to resume: a re-send is a hit again
            return replayed
        if ticket.write:
            recorder = Recorder(lambda raw: self._store_later(ticket.key, raw), self._config.max_entry_bytes)
            return driver.start(job, tap=recorder.wrap)
        return driver.start(job)

    async def _get(self, key: str) -> list[Recorded] | None:
        if self._store is None:
            return None
        try:
            raw = await self._store.get(key)
            return decode_entry(raw) if raw is not None else None
        except Exception as exc:  # noqa: BLE001 - a cache failure is a miss, never a failed request
            self._count("errors")
            log.debug("response cache %s: lookup failed: %r", self._store.name, exc)
            return None

    def _store_later(self, key: str, raw: bytes) -> None:
        task = asyncio.get_running_loop().create_task(self._put(key, raw))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _put(self, key: str, raw: bytes) -> None:
        if self._store is None:
            return
        try:
            await self._store.put(key, raw)
        except Exception as exc:  # noqa: BLE001 - as in _get
            self._count("errors")
            log.debug("response cache %s: store failed: %r", self._store.name, exc)
            return
        self._count("stores")

    def _count(self, name: str) -> None:
        if self._metrics is not None:
            getattr(self._metrics, name).inc()

    async def aclose(self) -> None:
        """Let stores in flight end (each bounded by the store's timeout), then close."""
        if self._pending:
            await asyncio.gather(*self._pending, return_exceptions=True)
        if self._store is not None:
            await self._store.aclose()
