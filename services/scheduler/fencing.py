"""Lease fencing: which generations an engine must end because the
scheduler's lease table (the truth) does not lease them to that engine.

Each load report lists the request ids the engine holds
(LoadReport.request_ids). An id whose request holds no lease on that engine
-- it migrated elsewhere while the engine was cut off, or its request is
gone -- is an orphan: it burns a batch slot and KV blocks, and a stale
reader could take duplicate text from it. The scheduler answers with a
`Fence` command naming such ids; the engine ends them
(services/engine/fencing.py).

What counts as leased to engine E (`holder(request_id) == E`,
`SchedulerCore.lease_holder`): a lease on E, a DETACHED lease on E (its
gateway vanished; kept for a resume), and a request ORPHANED from E (E's
Connect stream ended while the request's gateway still streams from it: the
gateway, not the scheduler, decides whether it moves).

No false fences, by three rules:
  - confirm: an id is fenced only when unleased on two consecutive reports
    at least `confirm_seconds` apart (a lease that ended a moment before a
    report, `done` racing it, is gone from the next report);
  - startup grace: nothing within `startup_grace_seconds` of the scheduler's
    start, while gateways re-attach the leases of running requests;
  - rejoin grace: nothing on an engine within `rejoin_grace_seconds` of its
    (re)registration, for the same re-attachment when the engine came late.
    After a healed partition the engine re-registers and every orphan it
    still runs is fenced this grace + confirm_seconds later.
A fenced id still reported is fenced again after another confirm period.

Ownership: one `FenceBook` per scheduler, called only from the event loop
(grpc_api.py, on each load report), like the core.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from services.common.config import FencingConfig

__all__ = ["FenceBook"]


@dataclass
class _Suspect:
    """An id reported unleased: since when, and on how many reports in a row."""

    since: float
    reports: int = 1


@dataclass
class _EngineFences:
    joined_at: float
    suspects: dict[str, _Suspect] = field(default_factory=dict)


class FenceBook:
    def __init__(self, config: FencingConfig, started: float) -> None:
        self._config = config
        self._started = started
        self._engines: dict[str, _EngineFences] = {}
        self.fenced_total = 0

    def joined(self, engine_id: str, now: float) -> None:
        """The engine (re)registered: its rejoin grace starts now."""
        self._engines[engine_id] = _EngineFences(now)

    def left(self, engine_id: str) -> None:
        self._engines.pop(engine_id, None)

    def check(
        self, engine_id: str, reported: Iterable[str], holder: Callable[[str], str | None], now: float
    ) -> list[str]:
        """The ids of this report to fence now (sorted). `holder` answers
        which engine a request id is leased to (None: to none)."""
        fences = self._engines.get(engine_id)
        if fences is None or not self._config.enabled:
            return []
        in_grace = (now < self._started + self._config.startup_grace_seconds
                    or now < fences.joined_at + self._config.rejoin_grace_seconds)
        suspects: dict[str, _Suspect] = {}
        fenced: list[str] = []
        for request_id in reported:
            if holder(request_id) == engine_id:
                continue
            suspect = fences.suspects.get(request_id)
            if suspect is None:
                suspects[request_id] = _Suspect(now)
                continue
            suspect.reports += 1
            suspects[request_id] = suspect
            if (not in_grace and suspect.reports >= 2
                    and now - suspect.since >= self._config.confirm_seconds):
                fenced.append(request_id)
                # Still reported after another confirm period -> fenced again.
                suspects[request_id] = _Suspect(now, 0)
        # Ids no longer reported (or leased again) stop being suspects.
        fences.suspects = suspects
        self.fenced_total += len(fenced)
        return sorted(fenced)
