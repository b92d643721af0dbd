"""Queue policy contracts and the built-in policies.

A class queue asks two questions: which tenant goes next (fairness) and
which of that tenant's requests goes next (ordering). Policies are
stateless; the per-class state lives in a `FairnessState` the queue owns and
hands to the policy, so one policy object serves every class and model.

Chosen fairness: round-robin over tenants with queued work. A tenant that
gains its first queued request joins the end of the rotation; a served
tenant goes to the end. So a tenant flooding a class gets one turn per round
like everyone else: another tenant's request waits at most one request of
each other tenant per round, and its first request at most one turn of the
flooder. Least-attained-service would also favour light tenants but needs a
notion of cost per request the scheduler cannot know before the request runs.

Policies are registered by name in the scheduler's one plugin registry
(placement/registry.py, `builtin_registry`) and chosen by the settings
`scheduler.queue_fairness` and `scheduler.queue_ordering`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Protocol

from .records import QueueEntry

__all__ = [
    "FairnessPolicy",
    "FairnessState",
    "FifoOrdering",
    "OrderingPolicy",
    "RoundRobinTenants",
]


@dataclass
class FairnessState:
    """Per-class fairness state: tenants with queued work, next first."""

    rotation: OrderedDict[str, None] = field(default_factory=OrderedDict)


class FairnessPolicy(Protocol):
    """Which tenant a class serves next.

    Promises: `next_tenant` returns a tenant in the rotation, or None iff the
    rotation is empty, and does not change the state; `rotation` lists every
    tenant with queued work exactly once, in the order the next round serves
    them (its first element is `next_tenant`).
    """

    name: str

    def next_tenant(self, state: FairnessState) -> str | None: ...

    def joined(self, state: FairnessState, tenant: str) -> None:
        """`tenant` now has queued work in this class (idempotent)."""

    def served(self, state: FairnessState, tenant: str, still_queued: bool) -> None:
        """One of `tenant`'s requests left the queue to be placed."""

    def left(self, state: FairnessState, tenant: str) -> None:
        """`tenant` has no queued work left in this class (withdrawal or aging)."""

    def rotation(self, state: FairnessState) -> list[str]: ...


class RoundRobinTenants:
    name = "round_robin_tenants"

    def next_tenant(self, state: FairnessState) -> str | None:
        return next(iter(state.rotation), None)

    def joined(self, state: FairnessState, tenant: str) -> None:
        if tenant not in state.rotation:
            state.rotation[tenant] = None

    def served(self, state: FairnessState, tenant: str, still_queued: bool) -> None:
        if still_queued:
            state.rotation.move_to_end(tenant)
        else:
            state.rotation.pop(tenant, None)

    def left(self, state: FairnessState, tenant: str) -> None:
        state.rotation.pop(tenant, None)

    def rotation(self, state: FairnessState) -> list[str]:
        return list(state.rotation)


class OrderingPolicy(Protocol):
    """Which of a tenant's requests goes next: the one with the smallest key.

    Promise: keys are totally ordered and distinct for distinct entries
    (the admission sequence number is the last component).
    """

    name: str

    def key(self, entry: QueueEntry) -> tuple[Hashable, ...]: ...


class FifoOrdering:
    """FIFO by arrival (a re-admitted request keeps its original arrival,
    so it goes back to where it was), then admission order."""

    name = "fifo"

    def key(self, entry: QueueEntry) -> tuple[float, int]:
        return (entry.arrival, entry.seq)

