"""The engine registry, built from engines' Connect streams.

An engine is registered by its hello and lives exactly as long as its
stream: each registration gets a connection token, and only the stream that
holds the current token can remove it (a stale stream's late close is
ignored).

Identity across restarts (`EngineInfo.incarnation`, chosen once per engine
process: unix milliseconds at start << 22 | 22 random bits, so a later start
compares greater and two starts in one millisecond are told apart by the
random bits; engine clocks need only agree to well within a restart's
duration, which NTP gives):
  - same id, same incarnation: the same process reconnecting (its old
    stream not yet ended here); the registration is replaced and its
    leases carry over;
  - same id, GREATER incarnation: a new process of that engine (a
    rescheduled pod: same id, new address -- or the same DNS name -- at
    once, never after a keepalive). It SUPERSEDES the registration whatever
    the address: the old one's leases end as if the engine was lost
    (`Registration.superseded`; the core orphans their requests and the
    gateways migrate them) and its stream is ended;
  - same id, SMALLER incarnation than the greatest seen for the id (kept
    after the newer one's stream ends too, and across scheduler restarts
    and replicas: before the hello reaches the registry it is checked
    against the shared record of incarnation_store.py): the old process
    is fenced out, `SupersededEngineError` (gRPC FAILED_PRECONDITION); the
    engine then ends its generations and exits instead of retrying.
Two DIFFERENT live engines configured with one id cannot be told apart
from a restart by the scheduler (both are live processes with an address):
the newer wins and the older exits, logged as an error on both sides with
both addresses (a registration superseded while its reports were fresh is
the tell-tale). Engines that send no incarnation (0) keep the old rule: the
same id from another address is refused (`DuplicateEngineError`) while the
first is connected. Freshness: an engine with no load report for
`stale_report_seconds` is not placed on. Owned by `EngineFleet` (fleet.py),
the only code that calls it.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

__all__ = [
    "DuplicateEngineError", "EngineInfo", "EngineLoad", "EngineRecord", "EngineRegistry", "Registration",
    "SupersededEngineError", "superseded_error",
]

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
    incarnation: int = 0        # 0 = not sent (an engine older than incarnations)
    model_revision: str = ""    # EngineHello.model_revision ("" = not sent)
    scheduler_replicas: int = 1  # EngineHello.scheduler_replicas (0 = not sent: one)


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
    # Prompt tokens looked up in / found in its prefix cache since it started.
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    # Its measured step speed (services/engine/step_speed.py); 0 = unknown.
    prefill_tokens_per_second: float = 0.0
    step_seconds: float = 0.0
    step_token_budget: int = 0
    # Generations it runs for other scheduler replicas (LoadReport.
    # other_replica_generations), and those it listed that this replica
    # does not lease there (a gone replica's, until re-attached here; an
    # orphan until fenced): they take lease slots here too.
    other_leases: int = 0
    unleased: int = 0
    # Its backend's outputs and answered liveness probes since it started
    # (LoadReport.backend_progress; 0 = not sent). Not compared: no
    # placement reads it, and it moves in every report of a working engine.
    backend_progress: int = field(default=0, compare=False)


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
    # When its backend's progress count last moved: the receive time of the
    # report it moved FROM (see `progressed_since`); and whether the last
    # report moved it.
    progress_moved_from: float | None = None
    progressed: bool = False

    @property
    def engine_id(self) -> str:
        return self.info.engine_id

    @property
    def slots_taken(self) -> int:
        """Lease slots in use: this replica's leases plus the generations the
        engine last reported running without a lease from this replica."""
        return len(self.leases) + self.load.other_leases + self.load.unleased

    def take_load(self, load: EngineLoad, now: float) -> bool:
        """Apply a report received at `now`; False when it repeats the last
        load (a heartbeat)."""
        self.progressed = load.backend_progress > self.load.backend_progress and self.last_report_at is not None
        if self.progressed:
            self.progress_moved_from = self.last_report_at
        same = load == self.load
        self.load, self.last_report_at = load, now
        return not same

    def progressed_since(self, at: float) -> bool:
        """Did its backend work after `at`: its progress count moved between
        two reports both received since? A count that moved only from a
        report received before (a hung core's last outputs, reported late)
        is no evidence: a core that stopped leaves the count where it was."""
        return self.progress_moved_from is not None and self.progress_moved_from >= at

    def fresh(self, now: float, stale_after: float) -> bool:
        return self.last_report_at is not None and now - self.last_report_at <= stale_after

    def blocks_total(self) -> int:
        return self.load.blocks_total or self.info.total_blocks

    def observe_service(self, seconds: float) -> None:
        self.service_seconds += _SERVICE_EWMA_ALPHA * (seconds - self.service_seconds)


class DuplicateEngineError(Exception):
    """A hello without an incarnation reused the id of an engine still
    connected from another address."""


class SupersededEngineError(Exception):
    """A hello from an older process of an engine a newer one replaced."""

    def __init__(self, message: str, newer_address: str) -> None:
        super().__init__(message)
        self.newer_address = newer_address


def superseded_error(info: EngineInfo, newest: int, newest_address: str) -> SupersededEngineError:
    """The refusal of a hello older than incarnation `newest` of its id."""
    return SupersededEngineError(
        f"engine id {info.engine_id!r}: this process ({info.address}, incarnation {info.incarnation}) was "
        f"superseded by a newer process of that id ({newest_address}, incarnation {newest}); "
        "it must stop. If that is not a restart of this engine, two engines share the id: give "
        "each its own (engines[].id / --engine-id)", newest_address)


@dataclass(frozen=True)
class Registration:
    """What a hello did: the new record; the one it `replaced` (the same
    process re-registering: leases carried over) or `superseded` (an older
    process: its leases are NOT carried over and must end)."""

    record: EngineRecord
    replaced: EngineRecord | None = None
    superseded: EngineRecord | None = None


def _same_process(old: EngineInfo, new: EngineInfo) -> bool:
    """A reconnect of the registered process: its incarnation, or, when
    either side sent none, its address."""
    if old.incarnation and new.incarnation:
        return old.incarnation == new.incarnation
    return old.address == new.address


class EngineRegistry:
    def __init__(self, initial_service_seconds: float) -> None:
        self._engines: dict[str, EngineRecord] = {}
        self._tokens = itertools.count(1)
        self._initial_service = initial_service_seconds
        # Per id, the greatest incarnation registered and its address: kept
        # after that process leaves, so an older one cannot come back.
        self._newest: dict[str, tuple[int, str]] = {}

    def __len__(self) -> int:
        return len(self._engines)

    def __iter__(self) -> Iterator[EngineRecord]:
        return iter(list(self._engines.values()))

    def get(self, engine_id: str) -> EngineRecord | None:
        return self._engines.get(engine_id)

    def records(self) -> Mapping[str, EngineRecord]:
        """Engine id -> its record, live (read only): for loops on the
        placement path that look up many ids."""
        return self._engines

    def __getitem__(self, engine_id: str) -> EngineRecord:
        return self._engines[engine_id]

    def register(self, info: EngineInfo, now: float) -> Registration:
        """Register (or re-register) an engine by the rules in the module
        docstring. Raises `SupersededEngineError` for an older incarnation
        and `DuplicateEngineError` (no incarnation) for an id connected from
        another address."""
        engine_id, incarnation = info.engine_id, info.incarnation
        newest, newest_address = self._newest.get(engine_id, (0, ""))
        if incarnation and incarnation < newest:
            raise superseded_error(info, newest, newest_address)
        old = self._engines.get(engine_id)
        supersedes = old is not None and 0 < old.info.incarnation < incarnation
        if old is not None and not supersedes and not _same_process(old.info, info):
            raise DuplicateEngineError(
                f"engine id {engine_id!r} is already connected from {old.info.address}; this engine "
                f"({info.address}) needs an id of its own (engines[].id / engine_id in the config)"
            )
        record = EngineRecord(
            info=info, token=next(self._tokens), connected_at=now,
            service_seconds=old.service_seconds if old else self._initial_service,
        )
        if incarnation:
            self._newest[engine_id] = (incarnation, info.address)
        self._engines[engine_id] = record
        if supersedes:
            return Registration(record, superseded=old)
        if old is not None:
            record.leases = old.leases
        return Registration(record, replaced=old)

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
