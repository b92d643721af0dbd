"""Lease slots with several scheduler replicas (README "Several schedulers"):
a replica fills an engine's slots with its own leases plus what the engine
runs for the other replicas (LoadReport.other_replica_generations) and, for
an engine reporting to several replicas, what it lists without a lease here
(a dead replica's generations until they re-attach here)."""

from __future__ import annotations

import dataclasses

from services.common.proto.kvmesh.v1 import scheduler_pb2
from services.scheduler.engine_links import EngineLinks

from .helpers import add_engine, admit, make_config, make_core, opts, report_load


def test_other_replicas_generations_take_lease_slots() -> None:
    core, _ = make_core()
    # max_running 8 + engine_queue_slack 2 = 10 slots, 1 of them P0's: 9 for a P1.
    token = add_engine(core, "e0", max_running=8, other_leases=9)
    admit(core, opts("r1"))
    assert core.lease_holder("r1") is None                 # queued: no slot left
    report_load(core, "e0", token, other_leases=8)
    assert core.lease_holder("r1") == "e0"
    # Alone (0 others) the same engine takes 9 of one replica's own.
    core, _ = make_core()
    add_engine(core, "e0", max_running=8)
    for i in range(10):
        admit(core, opts(f"r{i}"))
    assert [core.lease_holder(f"r{i}") for i in range(10)] == ["e0"] * 9 + [None]


def test_unleased_generations_count_only_for_an_engine_of_several_replicas() -> None:
    core, clock = make_core()
    links = EngineLinks(core, make_config(), clock, lambda _outbox: None)
    add_engine(core, "one")
    token = add_engine(core, "several", report=False)
    record = core.fleet.get("several")
    assert record is not None
    record.info = dataclasses.replace(record.info, scheduler_replicas=2)
    report_load(core, "several", token)
    admit(core, opts("mine"))
    engine = core.lease_holder("mine")
    assert engine in ("one", "several")
    report = scheduler_pb2.LoadReport(request_ids=["mine", "dead-replicas-1", "dead-replicas-2"])
    # One scheduler: read as always (an orphan waits for its fence, it takes no slot).
    assert links._unleased("one", report) == 0
    assert links._unleased("several", report) == (2 if engine == "several" else 3)
