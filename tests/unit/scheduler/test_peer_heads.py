"""Priority across scheduler replicas (services/scheduler/peer_heads.py): a
replica leaves room it could fill to a more urgent request another replica
has waiting -- within the bound: propagation, `hold_seconds` of room left to
one request, `stale_seconds` of silence. Two cores stand for two replicas,
one engine reporting to both (`other_leases`: what it runs for the other)."""

from __future__ import annotations

from services.common.clock import FakeClock
from services.common.config.peers import PeersConfig
from services.scheduler.core import SchedulerCore
from services.scheduler.events import PeerHeadsHeard, Tick
from services.scheduler.peer_heads import PeerHeads, QueueHead

from .helpers import add_engine, admit, make_core, opts, report_load

# max_running 8 + engine_queue_slack 2 = 10 lease slots, 1 kept for P0: 9 for P1 and P2.
FULL, ONE_FREE = 9, 8


def _tell(a: SchedulerCore, b: SchedulerCore, name: str = "B") -> None:
    """Replica `a` hears `b`'s queue heads, as WatchQueueHeads carries them."""
    a.handle(PeerHeadsHeard(name, tuple(b.waiting.heads())))


def _two_replicas() -> tuple[SchedulerCore, SchedulerCore, int, int, FakeClock]:
    clock = FakeClock()
    a, _ = make_core(clock)
    b, _ = make_core(clock)
    token_a = add_engine(a, "e0", other_leases=FULL)
    token_b = add_engine(b, "e0", other_leases=FULL)
    admit(a, opts("a-p2", priority=2))
    admit(b, opts("b-p1", priority=1))
    assert a.lease_holder("a-p2") is None and b.lease_holder("b-p1") is None   # both wait: the engine is full
    return a, b, token_a, token_b, clock


def _held(core: SchedulerCore, outcome: str) -> float:
    return core.metrics.peer_holds.labels(outcome)._value.get()


def test_a_free_slot_goes_to_the_more_urgent_request_of_the_other_replica() -> None:
    a, b, token_a, token_b, clock = _two_replicas()
    _tell(a, b)
    report_load(a, "e0", token_a, other_leases=ONE_FREE)    # A hears of the free slot first
    assert a.lease_holder("a-p2") is None                   # left to B's P1
    report_load(b, "e0", token_b, other_leases=ONE_FREE)
    assert b.lease_holder("b-p1") == "e0"
    report_load(a, "e0", token_a, other_leases=FULL)        # the engine tells A it is full again
    _tell(a, b)                                             # B has nothing waiting any more
    assert a.lease_holder("a-p2") is None
    clock.advance(0.2)                                      # past vanished_head_seconds
    report_load(a, "e0", token_a, other_leases=ONE_FREE)
    assert a.lease_holder("a-p2") == "e0"                   # nothing more urgent anywhere: A's turn
    assert _held(a, "held") == 1 and _held(a, "expired") == 0


def test_a_head_placed_elsewhere_holds_its_slot_until_the_engine_reports_it() -> None:
    """B places its P1 and its heads (now empty) reach A before the engine's
    report of the P1's start does: the slot still looks free to A, which
    must not fill it with its P2 (seen in the e2e test on a loaded machine:
    both placed on the one slot within a millisecond)."""
    a, b, token_a, token_b, clock = _two_replicas()
    _tell(a, b)
    report_load(b, "e0", token_b, other_leases=ONE_FREE)
    assert b.lease_holder("b-p1") == "e0"
    report_load(a, "e0", token_a, other_leases=ONE_FREE)    # A: the slot, before the engine reports B's P1
    assert a.lease_holder("a-p2") is None                   # left to B's P1 (still its head)
    _tell(a, b)                                             # B's heads first: nothing waits there
    assert a.lease_holder("a-p2") is None                   # B's P1 may have taken it: A waits
    clock.advance(0.05)
    a.handle(Tick())
    assert a.lease_holder("a-p2") is None
    report_load(a, "e0", token_a, other_leases=FULL)        # the engine's report: B's P1 runs there
    clock.advance(0.1)
    a.handle(Tick())
    assert a.lease_holder("a-p2") is None                   # full: nothing to place
    report_load(a, "e0", token_a, other_leases=ONE_FREE)    # it ends
    assert a.lease_holder("a-p2") == "e0"


def test_without_the_other_replicas_heads_the_first_to_hear_takes_the_slot() -> None:
    """The inversion the heads prevent (the same run, A not told)."""
    a, _b, token_a, _, _ = _two_replicas()
    report_load(a, "e0", token_a, other_leases=ONE_FREE)
    assert a.lease_holder("a-p2") == "e0"


def test_room_is_left_for_hold_seconds_at_most() -> None:
    """B's P1 does not take the room (here: B never hears of it); after
    `hold_seconds` of room left to it, A places its own."""
    a, b, token_a, _, clock = _two_replicas()
    hold = a.peers._hold
    _tell(a, b)
    report_load(a, "e0", token_a, other_leases=ONE_FREE)
    clock.advance(hold * 0.9)
    _tell(a, b)                                             # still waiting there, heard again: fresh
    a.handle(Tick())
    assert a.lease_holder("a-p2") is None
    clock.advance(hold * 0.2)
    _tell(a, b)
    a.handle(Tick())
    assert a.lease_holder("a-p2") == "e0"
    assert _held(a, "held") == 1 and _held(a, "expired") == 1


def test_only_time_with_room_counts_towards_the_hold() -> None:
    """Both wait for a full engine for longer than the hold: when a slot
    frees, it is still left to B's P1 (A could not have placed before)."""
    a, b, token_a, _, clock = _two_replicas()
    for _ in range(10):
        clock.advance(0.2)
        _tell(a, b)
        a.handle(Tick())
    assert _held(a, "held") == 0
    report_load(a, "e0", token_a, other_leases=ONE_FREE)
    assert a.lease_holder("a-p2") is None


def test_a_silent_replica_holds_nothing_back() -> None:
    a, b, token_a, _, clock = _two_replicas()
    _tell(a, b)
    clock.advance(PeersConfig().stale_seconds + 0.1)        # no heartbeat since: killed or cut off
    report_load(a, "e0", token_a, other_leases=ONE_FREE)
    assert a.lease_holder("a-p2") == "e0"
    assert _held(a, "held") == 0


def test_a_replica_gone_holds_nothing_back() -> None:
    a, b, token_a, _, _ = _two_replicas()
    _tell(a, b)
    a.handle(PeerHeadsHeard("B", None))                     # its stream ended
    report_load(a, "e0", token_a, other_leases=ONE_FREE)
    assert a.lease_holder("a-p2") == "e0"


def test_the_same_class_is_not_held_back() -> None:
    """Within a class each replica keeps its own order: no room is left."""
    clock = FakeClock()
    a, _ = make_core(clock)
    b, _ = make_core(clock)
    token_a = add_engine(a, "e0", other_leases=FULL)
    add_engine(b, "e0", other_leases=FULL)
    admit(a, opts("a-p1", priority=1))
    admit(b, opts("b-p1", priority=1))
    _tell(a, b)
    report_load(a, "e0", token_a, other_leases=ONE_FREE)
    assert a.lease_holder("a-p1") == "e0"


def test_heads_carry_the_class_aging_gave() -> None:
    """A P2 that waited one aging period is told as P1, and outranks a new P2 elsewhere."""
    clock = FakeClock()
    b, _ = make_core(clock)
    add_engine(b, "e0", other_leases=FULL)
    admit(b, opts("old", priority=2))
    assert b.waiting.heads() == [QueueHead("m", 2, "old")]
    clock.advance(b._config.aging.p2_seconds + 0.1)
    b.handle(Tick())
    assert b.waiting.heads() == [QueueHead("m", 1, "old")]


def test_the_rule_on_its_own() -> None:
    peers = PeerHeads(PeersConfig(stale_seconds=1.5, hold_seconds=0.5))
    peers.heard("B", [QueueHead("m", 1, "b1"), QueueHead("other", 0, "b0")], now=0.0)
    peers.heard("C", [QueueHead("m", 0, "c0")], now=0.0)
    assert peers.outranking("m", 2, 0.1) == ("C", QueueHead("m", 0, "c0"))   # the most urgent of all
    assert peers.outranking("m", 0, 0.1) is None                             # nothing outranks a P0
    assert peers.outranking("x", 2, 0.1) is None                             # another model's heads do not count
    assert peers.hold("C", QueueHead("m", 0, "c0"), 0.1) and peers.hold("C", QueueHead("m", 0, "c0"), 0.6)
    assert not peers.hold("C", QueueHead("m", 0, "c0"), 0.61)
    peers.heard("C", [QueueHead("m", 0, "c1")], now=0.7)                    # the next head: a hold of its own
    assert peers.hold("C", QueueHead("m", 0, "c1"), 0.7)
    assert peers.fresh(1.6) == ["C"] and peers.outranking("m", 2, 1.6) == ("C", QueueHead("m", 0, "c1"))
