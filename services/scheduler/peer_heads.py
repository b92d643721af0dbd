"""Priority across scheduler replicas: what the other replicas have waiting,
and the rule that leaves them room.

Each replica queues only the requests it owns (the gateway picks the owner by
rendezvous hashing of the request id), and every replica sees the same
engines' reports. Without a word between them, when a slot frees the first
replica to dispatch takes it -- a P2 of one can take it from a P1 of another.
So each replica streams the head of each model's queue (its most urgent
waiting request, aging applied: queue.py `peek`) to the others
(`Scheduler.WatchQueueHeads`, peer_watch.py / peer_feed.py), and a replica
about to place a request that a fresh head elsewhere outranks (a smaller
class rank for the same model) leaves the room to it instead.

The bound (README "Several schedulers"): a request is placed ahead of a
more urgent request waiting at another replica only
  - within the heads' propagation delay (`publish_interval_seconds`, 20 ms,
    plus a hop) after that request became its replica's head;
  - after this replica has left room to that same request for
    `hold_seconds` (0.5 s) and it was still not placed -- it did not fit
    where the room was (another engine's KV, an excluded engine, a longer
    context); only time with room counts: the hold starts when this replica
    could have placed (a trial placement, nothing remembered);
  - while the replicas do not hear each other (`stale_seconds`, 1.5 s): a
    killed or cut-off replica holds nothing back, and each replica's own
    order is then the only one.
A head that left its replica's queue still holds room for
`vanished_head_seconds` (0.1 s): it was most likely placed, and this
replica may hear that from the heads before it hears from the engine that
the slot is taken.
Within a class each replica keeps its own order (FIFO, tenant fairness):
requests of one class interleave across replicas by when each replica finds
room, and a tenant's requests spread over the replicas like everyone's
(rendezvous by request id), so each replica's fair share sees every tenant
in proportion. Not held: the Replace lane (generations already running, cut
off), and a preempting class's preemption of this replica's own leases.

Owned by the scheduler core (core.py; its one thread).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from services.common.config.peers import PeersConfig

__all__ = ["PeerHeads", "QueueHead"]


@dataclass(frozen=True)
class QueueHead:
    """One model's most urgent waiting request on one replica."""

    model: str
    priority: int          # class rank now, aging applied (0 = P0)
    request_id: str


@dataclass
class _Peer:
    heads: dict[str, QueueHead]    # model -> head
    heard_at: float
    # model -> (a head that left its queue since, when): placed, most likely
    vanished: dict[str, tuple[QueueHead, float]]


class PeerHeads:
    def __init__(self, config: PeersConfig, count: Callable[[str], None] | None = None) -> None:
        """`count(outcome)`: told "held" when room is first left to a head,
        "expired" when that hold runs out (the metrics)."""
        self._stale = config.stale_seconds
        self._hold = config.hold_seconds
        self._linger = config.vanished_head_seconds
        self._peers: dict[str, _Peer] = {}
        # (replica, request id) -> when this replica first left room to it.
        self._held_since: dict[tuple[str, str], float] = {}
        self._expired: set[tuple[str, str]] = set()
        self._count = count or (lambda outcome: None)

    def heard(self, replica: str, heads: Iterable[QueueHead], now: float) -> None:
        """`replica`'s heads as of now (its whole list: a model left out has nothing waiting)."""
        by_model = {head.model: head for head in heads}
        current = {head.request_id for head in by_model.values()}
        before = self._peers.get(replica)
        vanished = {} if before is None else {
            model: (head, at) for model, (head, at) in before.vanished.items() if now - at <= self._linger}
        if before is not None:
            for model, head in before.heads.items():
                if head.request_id not in current:
                    vanished[model] = (head, now)
        self._peers[replica] = _Peer(by_model, now, vanished)
        self._forget(lambda key: key[0] == replica and key[1] not in current)

    def gone(self, replica: str) -> None:
        """`replica`'s stream ended: it holds nothing back any more."""
        self._peers.pop(replica, None)
        self._forget(lambda key: key[0] == replica)

    def _forget(self, which: Callable[[tuple[str, str]], bool]) -> None:
        for key in [k for k in self._held_since if which(k)]:
            del self._held_since[key]
            self._expired.discard(key)

    def outranking(self, model: str, priority: int, now: float) -> tuple[str, QueueHead] | None:
        """The most urgent fresh head of another replica for `model` that
        outranks class rank `priority`, with its replica; None when none does."""
        best: tuple[str, QueueHead] | None = None
        for replica, peer in self._peers.items():
            if now - peer.heard_at > self._stale:
                continue
            gone = peer.vanished.get(model)
            for head in (peer.heads.get(model), gone[0] if gone and now - gone[1] <= self._linger else None):
                if head is not None and head.priority < priority and (best is None or head.priority < best[1].priority):
                    best = (replica, head)
        return best

    def hold(self, replica: str, head: QueueHead, now: float) -> bool:
        """Leave room this replica could fill to `head` of `replica`: True
        while its hold lasts (from the first time room was left to it),
        False once `hold_seconds` have passed."""
        key = (replica, head.request_id)
        since = self._held_since.get(key)
        if since is None:
            self._held_since[key] = since = now
            self._count("held")
        if now - since <= self._hold:
            return True
        if key not in self._expired:
            self._expired.add(key)     # counted once; stays expired while it is the head
            self._count("expired")
        return False

    def fresh(self, now: float) -> list[str]:
        """Replicas heard from within `stale_seconds`."""
        return sorted(name for name, peer in self._peers.items() if now - peer.heard_at <= self._stale)
