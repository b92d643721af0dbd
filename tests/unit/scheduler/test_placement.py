"""Placement policies, reservations, the engine registry and the KV index."""

from __future__ import annotations

from collections import Counter

import pytest

from services.common.config import ConfigError
from services.scheduler.events import (
    EngineLeft,
    FirstToken,
    KvSnapshotReported,
    ReplaceRequested,
    RequestArrived,
    RequestDone,
    StreamClosed,
    Tick,
)
from services.scheduler.records import PlacedInfo, QueuedInfo, RejectedInfo, RejectReason

from .helpers import add_engine, admit, asks_resync, make_core, opts, placed_engine, report_load

PREFIX = tuple(range(1, 9))     # 8 hash blocks = 128 tokens


def place(core, rid: str, **kw) -> str | None:
    notices = core.handle(RequestArrived(opts(rid, **kw))).notices
    first = notices[0][1]
    if isinstance(first, PlacedInfo):
        return first.engine_id
    return placed_engine(notices, rid) or (
        core.lease_of(rid).engine_id if core.lease_of(rid) else None)


# ---------------------------------------------------------------- sticky_until_saturated

def test_sticky_keeps_prefix_on_its_engine_then_spills_when_saturated() -> None:
    core, _ = make_core(policy="sticky_until_saturated", sticky_margin_seconds=0.5)
    t1 = add_engine(core, "e1", max_running=8)
    add_engine(core, "e2", max_running=8)
    core.handle(KvSnapshotReported("e1", t1, 0, PREFIX))

    assert place(core, "r1", prompt_tokens=128, prefix_hashes=PREFIX) == "e1"
    assert core.lease_of("r1").cached_tokens == 128
    # moderately busy: queueing 0.5 s more than e2, within the margin -> stays
    report_load(core, "e1", t1, running=8, waiting=1)
    assert place(core, "r2", prompt_tokens=128, prefix_hashes=PREFIX) == "e1"
    # saturated: far more queueing than the cold engine -> spills to least load
    report_load(core, "e1", t1, running=8, waiting=12)
    assert place(core, "r3", prompt_tokens=128, prefix_hashes=PREFIX) == "e2"


def test_sticky_counts_the_prefill_a_cold_engine_would_pay() -> None:
    # 2,000-token prompt, all of it cached on e1; e1 has 1 s of queued
    # prefill, e2 none. Queueing alone says spill (1 s > 0.5 s margin), but
    # e2 must prefill 2,000 tokens at 2,000 tok/s = 1 s: e1 starts sooner.
    core, _ = make_core(policy="sticky_until_saturated", sticky_margin_seconds=0.5,
                        prefill_tokens_per_second=2000.0)
    t1 = add_engine(core, "e1", max_running=8)
    add_engine(core, "e2", max_running=8)
    prefix = tuple(range(1000, 1125))  # 125 blocks = 2,000 tokens
    core.handle(KvSnapshotReported("e1", t1, 0, prefix))
    report_load(core, "e1", t1, running=2, queued_tokens=2000)
    assert place(core, "r1", prompt_tokens=2000, prefix_hashes=prefix) == "e1"
    # Five times that queue: now waiting costs more than prefilling on e2.
    report_load(core, "e1", t1, running=2, queued_tokens=10000)
    assert place(core, "r2", prompt_tokens=2000, prefix_hashes=prefix) == "e2"


def test_sticky_cold_prefix_goes_to_least_loaded() -> None:
    core, _ = make_core(policy="sticky_until_saturated")
    t1 = add_engine(core, "e1")
    add_engine(core, "e2")
    report_load(core, "e1", t1, running=6)
    assert place(core, "r", prefix_hashes=(99,)) == "e2"


def test_sticky_spreads_cold_prefixes_to_engines_caching_the_least() -> None:
    # Equally idle engines: a new prefix goes where the fewest contexts live.
    core, _ = make_core(policy="sticky_until_saturated")
    for engine_id, cached in (("e1", 600), ("e2", 100), ("e3", 300)):
        add_engine(core, engine_id, cached_blocks=cached)
    assert place(core, "r", prefix_hashes=(4242,)) == "e2"


# ---------------------------------------------------------------- other policies

def test_round_robin_cycles() -> None:
    core, _ = make_core(policy="round_robin")
    for e in ("e1", "e2", "e3"):
        add_engine(core, e)
    placed = [place(core, f"r{i}", prefix_hashes=PREFIX) for i in range(6)]
    assert placed == ["e1", "e2", "e3", "e1", "e2", "e3"]


def test_least_load_prefers_idle_engine() -> None:
    core, _ = make_core(policy="least_load")
    t1 = add_engine(core, "e1", max_running=16)
    add_engine(core, "e2", max_running=16)
    report_load(core, "e1", t1, running=5)
    placed = [place(core, f"r{i}") for i in range(5)]
    assert placed == ["e2"] * 5          # e2 catches up to e1's 5 first


def test_least_load_spreads_in_proportion_to_capacity() -> None:
    core, _ = make_core(policy="least_load")
    add_engine(core, "small", weight=1.0, total_blocks=2000, max_running=100)
    add_engine(core, "big", weight=2.0, total_blocks=4000, max_running=100)
    counts = Counter(place(core, f"r{i}") for i in range(30))
    assert 18 <= counts["big"] <= 22 and counts["small"] + counts["big"] == 30


def test_prefix_approx_remembers_where_it_sent_a_prefix() -> None:
    core, _ = make_core(policy="prefix_approx")
    add_engine(core, "e1")
    add_engine(core, "e2")
    first = place(core, "a1", prompt_tokens=128, prefix_hashes=PREFIX)
    # same prefix follows, though the other engine is idler; no KV events were sent
    assert place(core, "a2", prompt_tokens=128, prefix_hashes=PREFIX) == first
    assert core.lease_of("a2").cached_tokens == 128
    other = place(core, "b1", prompt_tokens=128, prefix_hashes=(50, 51))
    assert other != first


def test_kv_precise_follows_engine_kv_events() -> None:
    core, _ = make_core(policy="kv_precise")
    add_engine(core, "e1")
    t2 = add_engine(core, "e2")
    core.handle(KvSnapshotReported("e2", t2, 0, []))
    assert not asks_resync(core, "e2", t2, 1, PREFIX[:4], [], False)
    assert place(core, "r", prompt_tokens=128, prefix_hashes=PREFIX) == "e2"
    assert core.lease_of("r").cached_tokens == 64


def test_unknown_policy_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"scheduler.policy"):
        make_core(policy="fastest")


# ---------------------------------------------------------------- reservations

def test_reservations_prevent_overfilling_in_a_burst_between_reports() -> None:
    core, _ = make_core(policy="least_load", decode_headroom_tokens=256)
    token = add_engine(core, "e1", total_blocks=100, max_running=64)
    # each request: 320 prompt + 16 decode tokens = 21 blocks -> 4 fit in 100
    for i in range(10):
        admit(core, opts(f"r{i}", prompt_tokens=320, max_tokens=16))
    placed = [f"r{i}" for i in range(10) if core.lease_of(f"r{i}")]
    assert len(placed) == 4
    assert core.fleet.reservations.reserved("e1") == 84
    # the report shows them: reservations settle into blocks_used, still no room
    report_load(core, "e1", token, blocks_used=84, running=4, request_ids=placed)
    assert core.fleet.reservations.reserved("e1") == 0
    assert sum(1 for i in range(10) if core.lease_of(f"r{i}")) == 4
    # two finish; the next report frees their blocks -> exactly two more placed
    core.handle(RequestDone(placed[0]))
    core.handle(RequestDone(placed[1]))
    report_load(core, "e1", token, blocks_used=42, running=2, request_ids=placed[2:])
    assert sum(1 for i in range(10) if core.lease_of(f"r{i}")) == 4
    assert core.queued_total() == 4


def test_lease_slots_cap_in_flight_work() -> None:
    core, _ = make_core(engine_queue_slack=2, p0_reserved_leases=0)
    add_engine(core, "e1", max_running=3)
    for i in range(10):
        admit(core, opts(f"r{i}"))
    assert sum(1 for i in range(10) if core.lease_of(f"r{i}")) == 5


def test_reserved_lease_slot_takes_a_p0_at_once_when_batch_work_fills_the_engine() -> None:
    # Preemption off: this is the reserved slot alone (test_preemption.py has the rest).
    core, _ = make_core(engine_queue_slack=2, p0_reserved_leases=1, preempt_classes=[])
    add_engine(core, "e1", max_running=3)
    for i in range(10):
        admit(core, opts(f"p2-{i}", priority=2))
    assert sum(1 for i in range(10) if core.lease_of(f"p2-{i}")) == 4  # 5 slots, one kept for P0
    admit(core, opts("p0", priority=0))
    assert core.lease_of("p0") is not None and core.lease_of("p0").engine_id == "e1"
    admit(core, opts("p0-second", priority=0))
    assert core.lease_of("p0-second") is None  # the reserve is one slot, not a bypass


def test_reserve_never_takes_the_last_lease_slot() -> None:
    core, _ = make_core(engine_queue_slack=0, p0_reserved_leases=5)
    add_engine(core, "e1", max_running=1)
    admit(core, opts("p1"))
    assert core.lease_of("p1") is not None


# ---------------------------------------------------------------- registry and KV index

def test_stale_engine_is_not_placed_on() -> None:
    core, clock = make_core(stale_report_seconds=2.0)
    token = add_engine(core, "e1", report=True)
    clock.advance(2.5)
    assert isinstance(admit(core, opts("r")), QueuedInfo)
    assert core.lease_of("r") is None
    assert core.state().engines[0].view.fresh is False
    report_load(core, "e1", token)
    assert core.lease_of("r").engine_id == "e1"


def test_closed_engine_drops_kv_entries_and_leases() -> None:
    core, _ = make_core(policy="kv_precise")
    t1 = add_engine(core, "e1")
    core.handle(KvSnapshotReported("e1", t1, 0, PREFIX))
    assert place(core, "r", prompt_tokens=128, prefix_hashes=PREFIX) == "e1"
    core.handle(EngineLeft("e1", t1))
    assert core.fleet.kv.blocks("e1") == 0
    assert core.fleet.kv.prefix_matches(PREFIX, ["e1"]) == {"e1": 0}
    assert core.lease_of("r") is None
    assert core.request_state("r").value == "orphaned"
    assert core.state().leases_total == 0 and core.state().engines == []


def test_late_close_of_a_replaced_stream_is_ignored() -> None:
    core, _ = make_core()
    old = add_engine(core, "e1")
    new = add_engine(core, "e1")         # reconnect before the old stream's close arrived
    core.handle(EngineLeft("e1", old))
    assert core.fleet.get("e1") is not None
    core.handle(EngineLeft("e1", new))
    assert core.fleet.get("e1") is None


def test_kv_seq_gap_triggers_resync_and_snapshot_recovers() -> None:
    core, _ = make_core()
    t = add_engine(core, "e1")
    assert asks_resync(core, "e1", t, 1, [1], [], False) is True     # events before snapshot
    core.handle(KvSnapshotReported("e1", t, 5, [1, 2]))
    assert asks_resync(core, "e1", t, 6, [3], [1], False) is False
    assert core.fleet.kv.blocks("e1") == 2
    assert asks_resync(core, "e1", t, 8, [4], [], False) is True     # 7 went missing
    assert asks_resync(core, "e1", t, 9, [5], [], False) is False    # ignored until snapshot
    assert not core.fleet.kv.holds("e1", 5)
    core.handle(KvSnapshotReported("e1", t, 20, [2, 3, 4, 5]))
    assert asks_resync(core, "e1", t, 21, [], [], True) is False     # cleared
    assert core.fleet.kv.blocks("e1") == 0
    assert core.metrics.value("kvmesh_scheduler_kv_resyncs_total") == 2


# ---------------------------------------------------------------- replace and re-attach

def test_replace_places_elsewhere_ahead_of_the_queue() -> None:
    core, _ = make_core(engine_queue_slack=0, policy="least_load")
    tokens = {"e1": add_engine(core, "e1", max_running=1), "e2": add_engine(core, "e2", max_running=1)}
    first = place(core, "r1")
    second = place(core, "r2")
    assert {first, second} == {"e1", "e2"}
    assert isinstance(admit(core, opts("r3")), QueuedInfo)
    core.handle(EngineLeft(first, tokens[first]))
    assert core.request_state("r1").value == "orphaned"
    # r1's engine failed: nothing free on the other engine yet -> waits in the lane
    assert core.handle(ReplaceRequested("r1", (first,), 200, 10, ())).notices == []
    assert core.request_state("r1").value == "replacing"
    # room appears on the other engine: the replacement goes before queued r3
    out = dict(core.handle(RequestDone("r2")).notices)
    assert isinstance(out["r1"], PlacedInfo) and out["r1"].engine_id == second
    assert core.request_state("r3").value == "queued"


def test_replace_with_every_engine_excluded_is_rejected_after_the_return_bound() -> None:
    """Issue 29: the excluded engine still reports serving (a stopped core not
    yet declared hung), yet the replacement waits for an engine it does not
    exclude, engine_return_seconds from its Replace, then is refused."""
    core, clock = make_core(engine_return_seconds=30.0)
    add_engine(core, "e1")
    assert place(core, "r") == "e1"
    assert core.handle(ReplaceRequested("r", ("e1",), 40, 10, ())).notices == []
    assert core.request_state("r").value == "replacing"
    clock.advance(29.0)
    assert core.handle(Tick()).notices == []
    clock.advance(1.0)
    out = dict(core.handle(Tick()).notices)
    assert isinstance(out["r"], RejectedInfo) and out["r"].reason is RejectReason.NO_ENGINE
    assert core.request_state("r") is None


def test_replace_with_every_engine_excluded_waits_past_its_class_ttl() -> None:
    """The return bound, not the class TTL, bounds that wait (P0's TTL is 60 s)."""
    core, clock = make_core(engine_return_seconds=120.0)
    add_engine(core, "e1")
    assert place(core, "r", priority=0) == "e1"
    assert core.handle(ReplaceRequested("r", ("e1",), 40, 10, ())).notices == []
    clock.advance(90.0)
    assert core.handle(Tick()).notices == []
    add_engine(core, "e2")                 # an engine it does not exclude: placed at once
    lease = core.lease_of("r")
    assert lease is not None and lease.engine_id == "e2"


def test_a_replacement_that_comes_to_wait_for_an_engine_later_gets_the_return_bound() -> None:
    """r waits for room on e2 (its class TTL bounds that: P0, 60 s); then e2
    leaves, and every engine left is one r excludes: from then on it waits
    for an engine, engine_return_seconds from its Replace."""
    core, clock = make_core(engine_queue_slack=0, engine_return_seconds=120.0)
    add_engine(core, "e1", max_running=1)
    assert place(core, "r", priority=0) == "e1"
    e2 = add_engine(core, "e2", max_running=1)
    assert place(core, "s", priority=0) == "e2"
    assert core.handle(ReplaceRequested("r", ("e1",), 40, 10, ())).notices == []   # e2 full: waits for room
    core.handle(EngineLeft("e2", e2))
    clock.advance(90.0)                                                                # past P0's TTL
    assert [n for rid, n in core.handle(Tick()).notices if rid == "r"] == []
    add_engine(core, "e3")
    lease = core.lease_of("r")
    assert lease is not None and lease.engine_id == "e3"


def test_a_replacement_waiting_for_an_engine_holds_up_no_one() -> None:
    """Every engine is excluded for r, not for the others: new requests and
    later replacements are placed on e1 meanwhile (strict order is about
    room, and r competes for none here)."""
    core, _ = make_core()
    add_engine(core, "e1")
    assert place(core, "r") == "e1" and place(core, "q") == "e1"
    assert core.handle(ReplaceRequested("r", ("e1",), 40, 10, ())).notices == []
    assert place(core, "s") == "e1"
    out = dict(core.handle(ReplaceRequested("q", ("e9",), 40, 10, ())).notices)
    assert isinstance(out["q"], PlacedInfo) and out["q"].engine_id == "e1"
    assert core.request_state("r").value == "replacing"


def test_replace_while_queued_is_invalid() -> None:
    core, _ = make_core()
    add_engine(core, "e1", report=False)
    admit(core, opts("r"))
    out = dict(core.handle(ReplaceRequested("r", (), 40, 10, ())).notices)
    assert out["r"].reason is RejectReason.INVALID


def test_reattach_after_scheduler_restart() -> None:
    core, _ = make_core()
    add_engine(core, "e1")
    placed = admit(core, opts("r", running_on_engine="e1"))
    assert isinstance(placed, PlacedInfo) and placed.engine_id == "e1"
    assert core.fleet.reservations.reserved("e1") == 0
    assert core.state().engines[0].view.leases == 1
    # unknown engine -> placed normally
    assert isinstance(admit(core, opts("s", running_on_engine="gone")), QueuedInfo)
    assert core.lease_of("s").engine_id == "e1"


def test_finish_is_idempotent_and_frees_everything() -> None:
    core, _ = make_core()
    add_engine(core, "e1")
    place(core, "r")
    core.handle(FirstToken("r"))
    core.handle(RequestDone("r"))
    core.handle(RequestDone("r"))
    core.handle(StreamClosed("r"))
    assert core.state().leases_total == 0
    assert core.fleet.reservations.reserved("e1") == 0
    assert core.metrics.value("kvmesh_scheduler_requests_finished_total", {"outcome": "done"}) == 1


def test_together_leases_a_copy_on_its_twins_engine_at_once() -> None:
    """n > 1: choices 1..n-1 join choice 0's engine (one prefill there), even
    when another engine is emptier; otherwise they queue as any request."""
    core, _ = make_core()
    add_engine(core, "e1")
    add_engine(core, "e2")
    first = place(core, "r")
    other = "e2" if first == "e1" else "e1"
    place(core, "x")  # the other engine is now no busier than the first
    copy = admit(core, opts("r-n1", together_with="r"))
    assert isinstance(copy, PlacedInfo) and copy.engine_id == first
    assert core.lease_of("r-n1").engine_id == first
    # Another tenant's request, or a twin without a lease: placed as usual.
    stranger = admit(core, opts("s", tenant="other", together_with="r"))
    assert not isinstance(stranger, RejectedInfo)
    assert isinstance(admit(core, opts("t", together_with="nobody")), (QueuedInfo, PlacedInfo))
    assert other in {e.view.engine_id for e in core.state().engines}
