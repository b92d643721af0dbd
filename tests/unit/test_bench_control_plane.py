"""The control-plane benchmark's pure parts (scripts/bench_control_plane.py,
scripts/cplib/): the step schedule and arrivals, percentiles with unplaced
requests, the capacity rule, CPU and RSS from /proc text, the decision
histogram from /metrics text, a synthetic engine's cache and reports, and
the BENCHMARKS.md section."""

from __future__ import annotations

import math
import os
import random

import pytest

from scripts.cplib.benchmarks_md import SECTION, FleetResult, render_section, replace_section
from scripts.cplib.engines import EngineHostSpec, HostCounters, SynthEngine
from scripts.cplib.figures import Baseline, StepFigures, capacity, latency_percentile
from scripts.cplib.gateways import StepTally, merge_tallies
from scripts.cplib.plan import arrival_offsets, split_rate, step_rates
from scripts.cplib.procstat import cpu_seconds, rss_kib, run_delay_seconds, sample
from scripts.cplib.promhist import bucket_delta, bucket_quantile, histogram_buckets
from scripts.cplib.workload import Workload, context_hashes

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
