"""The engine registry, built from engines' Connect streams.

An engine is registered by its hello and lives exactly as long as its
stream: each registration gets a connection token, and only the stream that
holds the current token can remove it (a reconnect with the same id and
address replaces the registration -- an engine restarted before its old
stream's end reached us -- and the old stream's late close is then ignored).
The same id from another address while the first stream is open is refused:
two engines configured with one id would otherwise take each other's
registration, leases and KV index in turns. Freshness:
an engine with no load report for `stale_report_seconds` is not placed on.
Owned by `EngineFleet` (fleet.py), the only code that calls it.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field

__all__ = ["DuplicateEngineError", "EngineInfo", "EngineLoad", "EngineRecord", "EngineRegistry"]

# EWMA weight of one new lease duration in an engine's service-time estimate.
_SERVICE_EWMA_ALPHA = 0.1


@dataclass(frozen=True)
class EngineInfo:
    """What an engine's hello says about it."""

    engine_id: str
    address: str
    model: str
    block_size: int
    total_blocks: int
    max_running: int
    weight: float
    max_model_len: int
    backend: str = ""
    http_address: str = ""


@dataclass
class EngineLoad:
    """The engine's latest load report."""

    running: int = 0
    waiting: int = 0
    blocks_used: int = 0
    blocks_total: int = 0
    cached_blocks: int = 0
    serving: bool = False
    queued_tokens: int = 0
    request_ids: frozenset[str] = frozenset()


@dataclass
class EngineRecord:
    info: EngineInfo
    token: int
    connected_at: float
    last_report_at: float | None = None
    load: EngineLoad = field(default_factory=EngineLoad)
    draining: bool = False
    leases: set[str] = field(default_factory=set)      # lease ids
    service_seconds: float = 2.0                       # EWMA of lease durations

    @property
    def engine_id(self) -> str:
        return self.info.engine_id

    def fresh(self, now: float, stale_after: float) -> bool:
        return self.last_report_at is not None and now - self.last_report_at <= stale_after

    def blocks_total(self) -> int:
        return self.load.blocks_total or self.info.total_blocks

    def observe_service(self, seconds: float) -> None:
        self.service_seconds += _SERVICE_EWMA_ALPHA * (seconds - self.service_seconds)


class DuplicateEngineError(Exception):
    """A hello reused the id of an engine still connected from another address."""


class EngineRegistry:
    def __init__(self, initial_service_seconds: float) -> None:
        self._engines: dict[str, EngineRecord] = {}
        self._tokens = itertools.count(1)
        self._initial_service = initial_service_seconds

    def __len__(self) -> int:
        return len(self._engines)

    def __iter__(self) -> Iterator[EngineRecord]:
        return iter(list(self._engines.values()))

    def get(self, engine_id: str) -> EngineRecord | None:
        return self._engines.get(engine_id)

    def register(self, info: EngineInfo, now: float) -> tuple[EngineRecord, EngineRecord | None]:
        """Register (or re-register) an engine. Returns the new record and the
        one it replaced, if any; leases carry over (the gateway finds out
        itself if the engine process really changed). Raises
        `DuplicateEngineError` if the id is connected from another address."""
        old = self._engines.get(info.engine_id)
        if old is not None and old.info.address != info.address:
            raise DuplicateEngineError(
                f"engine id {info.engine_id!r} is already connected from {old.info.address}; this engine "
                f"({info.address}) needs an id of its own (engines[].id / engine_id in the config)"
            )
        record = EngineRecord(
            info=info,
            token=next(self._tokens),
            connected_at=now,
            service_seconds=old.service_seconds if old else self._initial_service,
        )
        if old is not None:
            record.leases = old.leases
        self._engines[info.engine_id] = record
        return record, old

    def unregister(self, engine_id: str, token: int) -> EngineRecord | None:
        """Remove the engine if `token` is its current registration."""
        record = self._engines.get(engine_id)
        if record is None or record.token != token:
            return None
        del self._engines[engine_id]
        return record

    def models(self) -> set[str]:
        return {r.info.model for r in self._engines.values()}

    def serves(self, model: str) -> bool:
        return any(r.info.model == model for r in self._engines.values())
