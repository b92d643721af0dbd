"""The control-plane benchmark's pure parts (scripts/bench_control_plane.py,
scripts/cplib/): the step schedule and arrivals, percentiles with unplaced
requests, the capacity rule, CPU and RSS from /proc text, the decision
histogram from /metrics text, a synthetic engine's cache and reports, and
the BENCHMARKS.md section; with several schedulers: the plan of fleets, the
figures summed and per replica, the capacity table, the synthetic gateways'
rendezvous spread, and a synthetic engine's per-replica reports, prompt
reports and fences."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import os
import random
from typing import cast

import grpc
import pytest

from scripts.cplib.benchmarks_md import (
    SECTION,
    FleetResult,
    capacity_table,
    render_section,
    replace_section,
    summary_line,
)
from scripts.cplib.engines import EngineHostSpec, HostCounters, SynthEngine, _Datagrams, _Link, listed_to
from scripts.cplib.figures import TABLE_HEADER, Baseline, StepFigures, capacity, latency_percentile, render_row
from scripts.cplib.gateways import StepTally, arrival_id, merge_tallies, owner_spread
from scripts.cplib.plan import FleetRun, arrival_offsets, fleet_plan, split_rate, step_rates
from scripts.cplib.procstat import cpu_seconds, rss_kib, run_delay_seconds, sample
from scripts.cplib.promhist import bucket_delta, bucket_quantile, histogram_buckets
from scripts.cplib.workload import Workload, context_hashes
from services.common.proto.kvmesh.v1 import scheduler_pb2
from services.gateway.scheduler_replicas import rendezvous_order

# ---------------------------------------------------------------- plan

@pytest.mark.parametrize(("start", "maximum", "expected"), [
    (100, 1600, [100, 200, 400, 800, 1600]),
    (100, 1599, [100, 200, 400, 800]),
    (100, 50, [100]),
    (250, 1000, [250, 500, 1000]),
])
def test_step_rates_double_up_to_the_maximum(start: float, maximum: float, expected: list[float]) -> None:
    assert step_rates(start, maximum) == expected


def test_step_rates_refuse_a_schedule_that_never_grows() -> None:
    with pytest.raises(ValueError):
        step_rates(100, 1000, factor=1.0)
    with pytest.raises(ValueError):
        step_rates(0, 1000)


def test_split_rate_shares_the_offer() -> None:
    assert split_rate(900, 3) == [300, 300, 300]
    with pytest.raises(ValueError):
        split_rate(900, 0)


def test_arrivals_are_seeded_poisson_at_the_rate() -> None:
    a = arrival_offsets(1000, 10.0, seed=3)
    assert a == arrival_offsets(1000, 10.0, seed=3)
    assert a != arrival_offsets(1000, 10.0, seed=4)
    assert all(0 <= t < 10.0 for t in a) and a == sorted(a)
    assert 9500 < len(a) < 10500          # 10,000 expected; sd 100
    assert arrival_offsets(0, 10.0, seed=1) == [] and arrival_offsets(10, 0, seed=1) == []


# ---------------------------------------------------------------- percentiles and capacity

def test_latency_percentile_without_missing_is_linear_interpolation() -> None:
    data = [float(x) for x in range(1, 101)]
    random.Random(1).shuffle(data)
    assert latency_percentile(data, 0, 50) == pytest.approx(50.5)
    assert latency_percentile(data, 0, 99) == pytest.approx(99.01)
    assert latency_percentile([], 0, 99) != latency_percentile([], 0, 99)   # NaN


def test_unplaced_requests_are_the_tail() -> None:
    data = [0.001] * 98
    assert latency_percentile(data, 2, 50) == 0.001
    assert math.isinf(latency_percentile(data, 2, 99))
    assert latency_percentile([0.001] * 999, 1, 99) == 0.001
    assert math.isinf(latency_percentile([], 3, 50))
    with pytest.raises(ValueError):
        latency_percentile(data, 0, 101)


def _step(offered: float, p99: float, placed_share: float = 1.0, rejected: int = 0, cpu: float = 1.0) -> StepFigures:
    placed = int(offered * 5 * placed_share)
    return StepFigures(engines=64, offered=offered, seconds=5.0, sent=int(offered * 5) - 7, placed=placed,
                       placed_in_window=placed, rejected=rejected, unplaced=0, p50_ms=p99 / 3, p99_ms=p99,
                       hist_p50_ms=0.1, hist_p99_ms=0.5, sched_cpu_s=cpu, sched_waited_s=0.8, driver_cpu_s=2.0,
                       wall_s=8.0, rss_kib=100 * 1024, late_p99_ms=0.0, engine_messages=800)


def test_capacity_is_the_highest_carried_step_within_the_p99_limit() -> None:
    steps = [_step(100, 1.0), _step(200, 2.0), _step(400, 6.0), _step(800, 4.0, placed_share=0.5)]
    best = capacity(steps)
    assert best is not None and best.offered == 200
    assert capacity([_step(100, 5.0)]) is not None                     # the limit itself is within
    assert capacity([_step(100, 5.01)]) is None
    assert capacity([_step(100, 1.0, rejected=1)]) is None             # a refusal is not carried
    # 95% of the 493 sent (Poisson), not of 100/s x 5 s: 470 placed is carried, 465 is not.
    assert capacity([_step(100, 1.0, placed_share=0.94)]) is not None
    assert capacity([_step(100, 1.0, placed_share=0.93)]) is None
    assert capacity([_step(100, math.inf)]) is None and capacity([]) is None
    saturation = capacity(steps, None)                                 # carried, whatever its p99
    assert saturation is not None and saturation.offered == 400


def test_cpu_per_admission_and_core_shares() -> None:
    s = _step(200, 1.0, cpu=2.0)     # 1000 placed, 2 s CPU over 8 s
    assert s.cpu_ms_per_admission == pytest.approx(2.0)
    assert s.sched_core_share == pytest.approx(0.25)
    assert s.driver_core_share == pytest.approx(0.25)
    assert s.sched_wait_share == pytest.approx(0.1)
    assert s.sustained == pytest.approx(200)
    assert Baseline(4, 1000, 1400).kib_per_engine == pytest.approx(100)


def test_gateway_tallies_merge() -> None:
    a = StepTally(sent=3, latencies=[0.1, 0.2], placed_in_window=2, rejected={"queue_full": 1}, late=[0.0] * 3)
    b = StepTally(sent=2, latencies=[0.3], placed_in_window=1, rejected={"queue_full": 1, "no_engine": 2},
                  unplaced=1, preempted=1, queued_messages=4, late=[0.5, 0.0])
    m = merge_tallies([a, b])
    assert (m.sent, m.placed_in_window, m.unplaced, m.preempted, m.queued_messages) == (5, 3, 1, 1, 4)
    assert m.latencies == [0.1, 0.2, 0.3] and m.late == [0.0, 0.0, 0.0, 0.5, 0.0]
    assert m.rejected == {"queue_full": 2, "no_engine": 2} and a.rejected == {"queue_full": 1}


# ---------------------------------------------------------------- /proc

STAT = ("4242 (python3 -m (x) y) S 1 4242 4242 0 -1 4194560 9000 0 12 0 "
        "1234 567 0 0 20 0 7 0 100 500000000 12000 18446744073709551615")


def test_cpu_seconds_reads_utime_and_stime_after_the_command_name() -> None:
    assert cpu_seconds(STAT, 100) == pytest.approx((1234 + 567) / 100)
    assert cpu_seconds(STAT, 1000) == pytest.approx(1.801)


def test_rss_from_status() -> None:
    assert rss_kib("Name:\tpython3\nVmPeak:\t  999 kB\nVmRSS:\t   52340 kB\nThreads:\t7\n") == 52340
    assert rss_kib("Name:\tzombie\n") == 0


def test_run_delay_sums_the_threads_waits() -> None:
    assert run_delay_seconds(["1000 2500000000 7\n", "5 500000000 1\n", ""]) == pytest.approx(3.0)


def test_sample_of_this_process() -> None:
    s = sample(os.getpid())
    assert s.cpu_s > 0 and s.rss_kib > 1000 and s.waited_s >= 0


# ---------------------------------------------------------------- /metrics

METRICS = """# HELP kvmesh_scheduler_decision_seconds Time to pick an engine
# TYPE kvmesh_scheduler_decision_seconds histogram
kvmesh_scheduler_decision_seconds_bucket{le="0.0001",policy="predicted_ttft"} 10.0
kvmesh_scheduler_decision_seconds_bucket{le="0.001",policy="predicted_ttft"} 90.0
kvmesh_scheduler_decision_seconds_bucket{le="0.01",policy="predicted_ttft"} 100.0
kvmesh_scheduler_decision_seconds_bucket{le="+Inf",policy="predicted_ttft"} 100.0
kvmesh_scheduler_decision_seconds_count{policy="predicted_ttft"} 100.0
kvmesh_scheduler_decision_seconds_sum{policy="predicted_ttft"} 0.05
kvmesh_scheduler_queue_wait_seconds_bucket{le="0.005",priority="P0"} 7.0
"""


def test_histogram_buckets_and_quantiles() -> None:
    buckets = histogram_buckets(METRICS, "kvmesh_scheduler_decision_seconds")
    assert buckets == {0.0001: 10.0, 0.001: 90.0, 0.01: 100.0, math.inf: 100.0}
    assert bucket_quantile(buckets, 0.5) == pytest.approx(0.0001 + 0.0009 * 40 / 80)
    assert bucket_quantile(buckets, 0.99) == pytest.approx(0.001 + 0.009 * 9 / 10)
    assert bucket_quantile(buckets, 0.05) == pytest.approx(0.00005)
    delta = bucket_delta(buckets, {0.0001: 10.0, 0.001: 10.0, 0.01: 10.0, math.inf: 10.0})
    assert delta == {0.0001: 0.0, 0.001: 80.0, 0.01: 90.0, math.inf: 90.0}
    assert math.isnan(bucket_quantile({}, 0.5))
    assert math.isinf(bucket_quantile({0.001: 0.0, math.inf: 5.0}, 0.99))   # past the last bound


# ---------------------------------------------------------------- synthetic engine

def _engine(total_blocks: int = 400) -> SynthEngine:
    w = Workload(groups=4, context_tokens=160)     # 10 blocks per context
    spec = EngineHostSpec(0, 1, ("127.0.0.1:1",), w, total_blocks=total_blocks, max_running=2)
    return SynthEngine("synth-0", spec, context_hashes(w), HostCounters())


def test_a_start_stores_its_prefix_once_and_counts_its_load() -> None:
    engine = _engine()
    contexts = context_hashes(engine.spec.workload)
    engine.start("r1", 1, (11, 12))
    engine.start("r2", 1, (13, 14))
    first, second = engine.events
    assert list(first.stored) == [*contexts[1], 11, 12] and not first.removed
    assert list(second.stored) == [13, 14]                  # the context is cached now
    report = engine.load()
    assert report.running == 2 and set(report.request_ids) == {"r1", "r2"}
    assert report.cached_blocks == 14 and report.blocks_used == 10 + 2 * (2 + 1)
    assert report.prefix_cache_queries == 2 * 192 and report.prefix_cache_hits == 160
    engine.start("r3", 2, (15, 16))
    assert engine.load().waiting == 1                       # past max_running
    engine.end("r1")
    engine.end("r1")
    assert set(engine.load().request_ids) == {"r2", "r3"}


def test_the_cache_evicts_the_least_recently_used_context() -> None:
    engine = _engine(total_blocks=25)
    contexts = context_hashes(engine.spec.workload)
    engine.start("a", 0, (1, 2))
    engine.start("b", 1, (3, 4))
    engine.start("c", 2, (5, 6))                             # 10+2+10+2+10 > 25: context 0 goes
    assert list(engine.events[-1].removed) == list(contexts[0])
    assert list(engine.groups) == [1, 2]
    assert set(engine.held()) == {*contexts[1], *contexts[2], 1, 2, 3, 4, 5, 6}


def test_context_hashes_are_the_gateway_hash_space() -> None:
    w = Workload(groups=2, context_tokens=40)
    a, b = context_hashes(w)
    assert len(a) == 2 and a != b and context_hashes(w) == [a, b]


# ---------------------------------------------------------------- BENCHMARKS.md

def test_section_replaced_in_place_or_appended() -> None:
    result = FleetResult(Baseline(64, 100 * 1024, 110 * 1024, 0.05), [_step(100, 1.0), _step(200, 9.0)])
    text = render_section("cmd --x", "2026-12-04 04:40 UTC", "load 1 before", [result], "a note")
    assert text.startswith(SECTION + "\n") and "cmd --x" in text and "a note" in text
    assert "capacity **100 admissions/s**" in text and "160 KiB per engine" in text and "5% of a core" in text
    assert "highest step carried 200/s (p99 9.0 ms" in text
    assert "| 64 | 1 | 100 | " in text and "| 64 | 1 | 200 | " in text
    twice = render_section("cmd", "now", "load", [result, result])
    assert "| 64 | 2 | 200 | " in twice and twice.count("| 64 | 1 | ") == 2
    none = render_section("cmd", "now", "load", [FleetResult(Baseline(8, 1, 2), [_step(100, 7.0)])])
    assert "capacity **none**" in none and "highest step carried 100/s" in none
    doc = "# B\n\n## A\n\nx\n"
    once = replace_section(doc, text)
    assert once == doc + "\n" + text
    twice = replace_section(once.replace("## A", "## A") + "\n## Z\n\nz\n", text.replace("cmd --x", "cmd --y"))
    assert "cmd --y" in twice and "cmd --x" not in twice and twice.endswith("## Z\n\nz\n")
    assert twice.count(SECTION) == 1


# ---------------------------------------------------------------- several schedulers

def test_fleet_plan_measures_each_fleet_with_each_scheduler_count_in_a_row() -> None:
    plan = fleet_plan([64, 256], [1, 2, 3], repeat=2)
    assert [(f.engines, f.schedulers, f.run) for f in plan[:7]] == [
        (64, 1, 1), (64, 1, 2), (64, 2, 1), (64, 2, 2), (64, 3, 1), (64, 3, 2), (256, 1, 1)]
    assert len(plan) == 12 and plan[-1] == FleetRun(256, 3, 2)
    assert fleet_plan([64], [1]) == [FleetRun(64, 1, 1)]
    for bad in (([64], [0], 1), ([64], [], 1), ([], [1], 1), ([64], [1], 0)):
        with pytest.raises(ValueError):
            fleet_plan(*bad)


def _replicated(offered: float, p99: float, cpu: tuple[float, ...], placed: tuple[int, ...]) -> StepFigures:
    s = _step(offered, p99, cpu=sum(cpu))
    return dataclasses.replace(s, schedulers=len(cpu), replica_cpu_s=cpu,
                               replica_rss_kib=tuple(100 * 1024 + 1024 * i for i in range(len(cpu))),
                               rss_kib=100 * 1024 + 1024 * (len(cpu) - 1), replica_placed=placed)


def test_cpu_per_admission_is_summed_over_the_replicas_and_shown_per_replica() -> None:
    s = _replicated(200, 1.0, (1.5, 0.5), (600, 400))        # 1000 placed
    assert s.cpu_ms_per_admission == pytest.approx(2.0)
    assert s.replica_cpu_ms_per_admission == pytest.approx((1.5, 0.5))
    assert s.sched_core_share == pytest.approx(0.25)
    row = render_row(s)
    assert row.startswith("| 2 | 64 | 1 | 200 | ") and "| 2.00 (1.50 + 0.50) |" in row and "| 100 / 101 |" in row
    header_cells = TABLE_HEADER.splitlines()[0].count("|")
    assert row.count("|") == header_cells                    # the per-replica figures share their cells
    one = render_row(_step(200, 1.0, cpu=2.0))
    assert one.startswith("| 1 | 64 | 1 | 200 | ") and "| 2.00 |" in one and "(" not in one
    assert one.count("|") == header_cells


def test_summary_and_capacity_table_with_several_schedulers() -> None:
    two = FleetResult(Baseline(64, 90 * 1024, 100 * 1024, 0.10, schedulers=2,
                               replica_rss_fleet_kib=(100 * 1024, 101 * 1024)),
                      [_replicated(100, 1.0, (0.3, 0.2), (250, 250)), _replicated(200, 6.0, (1.2, 0.8), (600, 400))])
    line = summary_line(two)
    assert line.startswith("64 engines, 2 schedulers: capacity **100 admissions/s**")
    assert "scheduler 1.00 ms (0.60 + 0.40 per replica) CPU per admission, admissions per replica 50% / 50%" in line
    assert "highest step carried 200/s" in line and "60% / 40%" in line
    assert "(each replica's: 100 / 101 MiB)" in line and "KiB per engine each" in line
    one = FleetResult(Baseline(64, 90 * 1024, 100 * 1024), [_step(100, 1.0), _step(200, 2.0)])
    assert summary_line(one).startswith("64 engines, 1 scheduler: capacity **200 admissions/s**")
    assert "per replica" not in summary_line(one)
    none = FleetResult(Baseline(256, 1, 2, schedulers=2), [_replicated(100, 9.0, (0.1, 0.1), (1, 1))])
    table = capacity_table([one, two, one, none])
    assert table.splitlines() == [
        "| engines | 1 scheduler | 2 schedulers |", "|---:|---:|---:|",
        "| 64 | 200 (1.00 ms) / 200 (1.00 ms) | 100 (1.00 ms) |", "| 256 | - | none |"]
    section = render_section("cmd", "now", "load", [one, two])
    assert "| engines | 1 scheduler | 2 schedulers |" in section
    assert "| 1 | 64 | 1 | 100 | " in section and "| 2 | 64 | 1 | 100 | " in section   # runs per (engines, schedulers)
    assert "| engines | 1 scheduler |" not in render_section("cmd", "now", "load", [one, one])


def test_synthetic_gateways_spread_admissions_by_the_gateways_rendezvous_choice() -> None:
    ids = [arrival_id(g, step, n) for g in range(2) for step in range(3) for n in range(1000)]
    for addresses in (["127.0.0.1:20001", "127.0.0.1:20002"], ["a:1", "b:2", "c:3"]):
        spread = owner_spread(ids, addresses)
        assert sum(spread.values()) == len(ids) and set(spread) == set(addresses)
        even = len(ids) / len(addresses)
        assert all(abs(n - even) < 0.1 * even for n in spread.values()), spread
        assert spread == owner_spread(ids, list(reversed(addresses)))   # the order given does not matter
    # Dropping a replica moves only its own requests (the gateway's rendezvous_order).
    three, two = ["a:1", "b:2", "c:3"], ["a:1", "b:2"]
    moved = [r for r in ids if rendezvous_order(r, three)[0] != rendezvous_order(r, two)[0]]
    assert moved and all(rendezvous_order(r, three)[0] == "c:3" for r in moved)
    assert owner_spread(ids[:5], ["only:1"]) == {"only:1": 5}


def test_merged_tallies_add_the_replicas_admissions() -> None:
    a = StepTally(by_replica={"x": 2, "y": 1}, moved=1)
    b = StepTally(by_replica={"y": 3})
    m = merge_tallies([a, b])
    assert m.by_replica == {"x": 2, "y": 4} and m.moved == 1


class _FakeCall:
    """A Connect stream's engine side: what the engine wrote."""

    def __init__(self) -> None:
        self.sent: list[scheduler_pb2.EngineMessage] = []

    async def write(self, message: scheduler_pb2.EngineMessage) -> None:
        self.sent.append(message)

    def loads(self) -> list[scheduler_pb2.LoadReport]:
        return [m.load for m in self.sent if m.WhichOneof("msg") == "load"]


def _replicated_engine(replicas: tuple[str, ...] = ("A", "B")) -> tuple[SynthEngine, list[_FakeCall]]:
    w = Workload(groups=4, context_tokens=160)
    spec = EngineHostSpec(0, 1, tuple(f"127.0.0.1:{i + 1}" for i in range(len(replicas))), w,
                          report_interval=10.0, heartbeat=10.0)
    engine = SynthEngine("synth-0", spec, context_hashes(w), HostCounters())
    calls = [_FakeCall() for _ in replicas]
    engine.links = [_Link(cast(grpc.aio.StreamStreamCall, c), replica=r) for c, r in zip(calls, replicas, strict=True)]
    return engine, calls


def test_each_replica_is_told_only_its_own_generations() -> None:
    engine, _ = _replicated_engine()
    engine.start("a1", 0, (1,), "A")
    engine.start("b1", 1, (2,), "B")
    engine.start("n1", 2, (3,), "")
    to_a, to_b = engine.load(replica="A"), engine.load(replica="B")
    assert set(to_a.request_ids) == {"a1", "n1"} and to_a.other_replica_generations == 1
    assert set(to_b.request_ids) == {"b1", "n1"} and to_b.other_replica_generations == 1
    assert to_a.running == to_b.running == 3                   # the engine's load is the engine's
    assert set(engine.load().request_ids) == {"a1", "b1", "n1"}
    # A replica gone (its stream ended): its generations are listed to the others.
    assert listed_to(engine.owners, engine.running, "A", {"A"}) == (["a1", "b1", "n1"], 0)
    assert listed_to(engine.owners, engine.running, "A", set()) == (["a1", "b1", "n1"], 0)   # none named yet
    assert listed_to(engine.owners, engine.running, "", {"A", "B"}) == (["a1", "b1", "n1"], 0)
    assert engine.hello("127.0.0.1:9", 7).scheduler_replicas == 2


async def test_a_start_and_an_end_are_reported_to_every_replica_at_once() -> None:
    engine, (to_a, to_b) = _replicated_engine()
    loop = asyncio.get_running_loop()
    writer = loop.create_task(engine.write_loop(loop))
    try:
        engine.last_load_at = loop.time()      # a report just went out: the gap would hold the next
        engine.start("a1", 0, (1,), "A")
        await asyncio.sleep(0.01)
        assert [list(r.request_ids) for r in to_a.loads()] == [["a1"]]
        assert [r.other_replica_generations for r in to_b.loads()] == [1] and not to_b.loads()[0].request_ids
        assert all(any(m.WhichOneof("msg") == "kv_events" for m in c.sent) for c in (to_a, to_b))
        engine.end("a1")
        await asyncio.sleep(0.01)
        assert len(to_a.loads()) == len(to_b.loads()) == 2 and not to_a.loads()[-1].request_ids
        assert engine.counters["loads"] == 4 and engine.counters["kv_events"] == 2
    finally:
        writer.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await writer


def test_one_replica_keeps_the_report_gap_and_a_fence_ends_only_its_replicas_generations() -> None:
    single, _ = _replicated_engine(("A",))
    single.start("r", 0, (1,), "A")
    assert single.changed and not single.urgent                # one scheduler: rate-limited, as ever
    engine, _ = _replicated_engine()
    engine.start("a1", 0, (1,), "A")
    assert engine.urgent
    fence = scheduler_pb2.SchedulerCommand(fence=scheduler_pb2.Fence(request_ids=["a1"]))
    engine.on_command(engine.links[1], fence)                  # B did not lease it
    assert "a1" in engine.running and engine.counters["not_fenced"] == 1
    engine.on_command(engine.links[0], fence)
    assert "a1" not in engine.running and engine.counters["fenced"] == 1


def test_a_start_datagram_carries_the_placing_replica() -> None:
    engine, _ = _replicated_engine()
    datagrams = _Datagrams({"synth-0": engine})
    datagrams.datagram_received(b"S synth-0 r1 1 host/12/abc 5 6", ("127.0.0.1", 1))
    datagrams.datagram_received(b"S synth-0 r2 2 - 7 8", ("127.0.0.1", 1))
    assert engine.owners == {"r1": "host/12/abc", "r2": ""}
    assert list(engine.events[0].stored)[-2:] == [5, 6]
    datagrams.datagram_received(b"E synth-0 r1", ("127.0.0.1", 1))
    assert set(engine.running) == {"r2"}
