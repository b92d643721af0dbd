"""Deadlines from live latency (services/scheduler/deadlines.py): the window's
p95, the clamp, the minimum sample count, and what the core does with them --
on a fake clock."""

from __future__ import annotations

import pytest

from services.common.clock import FakeClock
from services.common.config import ConfigError, MeshConfig, config_from_dict, validate_config
from services.scheduler.core import SchedulerCore
from services.scheduler.deadlines import DeadlineBook, DeadlineKind, Source
from services.scheduler.events import FirstToken, RequestArrived, RequestDone, Tick
from services.scheduler.latency_window import LatencyWindow
from services.scheduler.records import AdmitOptions, PlacedInfo, QueuedInfo, RejectedInfo, RejectReason

from .helpers import MODEL, add_engine, admit, make_config, opts, report_load

QW, FT, STALL, GEN = (DeadlineKind.QUEUE_WAIT, DeadlineKind.FIRST_TOKEN, DeadlineKind.TOKEN_STALL,
                      DeadlineKind.GENERATION)


def _config(**deadlines: object) -> MeshConfig:
    config = make_config(queue_ttl_seconds=[60.0, 300.0, 3600.0])
    config.deadlines.min_samples = 5
    config.deadlines.window_samples = 20
    config.deadlines.window_seconds = 100.0
    for key, value in deadlines.items():
        setattr(config.deadlines, key, value)
    return config


# ---------------------------------------------------------------- the window


def test_window_p95_is_nearest_rank_and_bounded_by_count_and_age() -> None:
    window = LatencyWindow(max_samples=100, max_age_seconds=10.0)
    assert window.p95(0.0) is None
    for i in range(1, 101):                       # 1 .. 100 at t = 0
        window.add(float(i), 0.0)
    assert window.p95(0.0) == 95.0
    window.add(1000.0, 1.0)                        # count-bounded: 1 drops out
    assert window.count(1.0) == 100 and window.p95(1.0) == 96.0
    assert window.count(10.5) == 1                 # age-bounded: only the t=1 sample is left
    assert window.p95(10.5) == 1000.0
    assert window.count(11.5) == 0 and window.p95(11.5) is None


def test_window_follows_a_speed_change_within_a_few_percent_new_samples() -> None:
    window = LatencyWindow(max_samples=100, max_age_seconds=1e9)
    for _ in range(100):
        window.add(0.01, 0.0)
    for _ in range(6):                             # > 5% of the window now 5x slower
        window.add(0.05, 1.0)
    assert window.p95(1.0) == 0.05


def test_window_p95_may_be_a_little_stale_when_asked_to() -> None:
    window = LatencyWindow(max_samples=100, max_age_seconds=100.0, max_staleness_seconds=1.0)
    window.add(1.0, 0.0)
    assert window.p95(0.0) == 1.0
    window.add(9.0, 0.5)
    assert window.p95(0.5) == 1.0 and window.count(0.5) == 2    # sorted at 0.0: reused until 1.0
    assert window.p95(1.0) == 9.0


# ---------------------------------------------------------------- the clamp


@pytest.mark.parametrize(("p95", "seconds", "source"), [
    (0.1, 5.0, Source.FLOOR),        # 3 x 0.1 = 0.3 < floor 5
    (2.0, 6.0, Source.DERIVED),      # 3 x 2 = 6
    (20.0, 30.0, Source.CEILING),    # 3 x 20 = 60 > ceiling 30
])
def test_clamp_by_floor_and_ceiling(p95: float, seconds: float, source: Source) -> None:
    book = DeadlineBook(_config())
    for _ in range(5):
        book.observe_gaps(MODEL, 1, [p95], 0.0)
    d = book.deadline(STALL, MODEL, 1, 0.0)
    assert (d.seconds, d.source, d.p95, d.samples) == (seconds, source, p95, 5)


def test_the_ceiling_stands_until_min_samples() -> None:
    book = DeadlineBook(_config())
    for i in range(4):
        book.observe(FT, MODEL, 0, 2.0, float(i))
        d = book.deadline(FT, MODEL, 0, float(i))
        assert (d.seconds, d.source, d.samples) == (30.0, Source.DEFAULT, i + 1)
    book.observe(FT, MODEL, 0, 2.0, 4.0)
    assert book.deadline(FT, MODEL, 0, 4.0).seconds == pytest.approx(10.0)   # floor 10 > 3 x 2
    assert book.deadline(FT, MODEL, 1, 4.0).source is Source.DEFAULT          # per class


def test_ceilings_are_the_fixed_values_of_before() -> None:
    config = _config()
    config.gateway.max_generation_seconds = 90.0
    book = DeadlineBook(config)
    assert [book.ceiling(QW, c) for c in range(3)] == [60.0, 300.0, 3600.0]
    assert book.ceiling(GEN, 1) == 90.0
    assert book.ceiling(STALL, 1) == 30.0
    config.deadlines.queue_wait.ceiling_seconds = 100.0     # a configured ceiling caps, never loosens
    assert [DeadlineBook(config).ceiling(QW, c) for c in range(3)] == [60.0, 100.0, 100.0]


def test_generation_is_from_first_token_and_gap_p95s() -> None:
    config = _config()
    config.deadlines.generation.floor_seconds = 1.0
    book = DeadlineBook(config)
    assert book.generation(MODEL, 1, 100, 0.0).source is Source.DEFAULT
    for _ in range(5):
        book.observe(FT, MODEL, 1, 0.5, 0.0)
        book.observe_gaps(MODEL, 1, [0.05], 0.0)
    d = book.generation(MODEL, 1, 100, 0.0)
    assert d.seconds == pytest.approx(3 * (0.5 + 100 * 0.05)) and d.source is Source.DERIVED
    assert book.generation(MODEL, 1, 10_000, 0.0).source is Source.CEILING      # 120 s


def test_a_longer_prompt_than_usual_gets_a_longer_first_token_deadline() -> None:
    core, clock, token = _core()
    for i in range(6):                              # 1000-token prompts, first token after 5 s
        _placed(core, opts(f"r{i}", prompt_tokens=1000))
        clock.advance(5.0)
        core.handle(FirstToken(f"r{i}"))
        core.handle(RequestDone(f"r{i}"))
        report_load(core, "e1", token)
    usual = _placed(core, opts("usual", prompt_tokens=800)).deadlines
    assert usual is not None and usual.first_token_seconds == pytest.approx(15.0)      # 3 x 5 s
    core.handle(RequestDone("usual"))
    report_load(core, "e1", token)
    longer = _placed(core, opts("longer", prompt_tokens=1500)).deadlines
    assert longer is not None and longer.first_token_seconds == pytest.approx(22.5)    # x 1500 / 1000
    core.handle(RequestDone("longer"))
    report_load(core, "e1", token)
    huge = _placed(core, opts("huge", prompt_tokens=9000)).deadlines
    assert huge is not None and huge.first_token_seconds == pytest.approx(30.0)        # the ceiling


def test_disabled_means_the_fixed_values_and_no_placed_deadlines() -> None:
    book = DeadlineBook(_config(enabled=False))
    for _ in range(10):
        book.observe(QW, MODEL, 0, 0.1, 0.0)
    d = book.queue_bound(MODEL, 0, 0.0)
    assert (d.seconds, d.source, d.samples) == (60.0, Source.DEFAULT, 0)
    placed = PlacedInfo("e", "e:1", "l", 0)
    notices: list = [("r", placed)]
    book.stamp_all(notices, lambda _rid: None, 0.0)
    assert notices[0][1].deadlines is None


def test_config_bounds_are_checked() -> None:
    validate_config(config_from_dict(MeshConfig, {"deadlines": {"token_stall": {"floor_seconds": 1}}}))
    for bad in ({"multiple": 0.5}, {"min_samples": 0}, {"min_samples": 5, "window_samples": 4},
                {"token_stall": {"floor_seconds": 0}}, {"queue_wait": {"ceiling_seconds": -1}}):
        with pytest.raises(ConfigError, match="deadlines"):
            validate_config(config_from_dict(MeshConfig, {"deadlines": bad}))


# ---------------------------------------------------------------- in the core


def _core(**deadlines: object) -> tuple[SchedulerCore, FakeClock, int]:
    clock = FakeClock()
    core = SchedulerCore(_config(**deadlines), clock)
    token = add_engine(core, "e1", max_running=1)
    return core, clock, token


def _placed(core: SchedulerCore, options: AdmitOptions) -> PlacedInfo:
    """Admit and return the placement the dispatch after it made."""
    notices = [n for rid, n in core.handle(RequestArrived(options)).notices if rid == options.request_id]
    assert isinstance(notices[-1], PlacedInfo), notices
    return notices[-1]


def _hold(core: SchedulerCore) -> None:
    core.fleet.get("e1").last_report_at = None     # stale: nothing is placed until its next report


def test_placed_carries_the_deadlines_learned_from_first_tokens_and_gaps() -> None:
    core, clock, token = _core()
    for i in range(6):
        placed = _placed(core, opts(f"r{i}", max_tokens=100))
        assert placed.deadlines is not None
        if i < 2:  # fewer than min_samples first tokens (and gaps) so far: the ceilings
            assert (placed.deadlines.first_token_seconds, placed.deadlines.token_stall_seconds) == (30.0, 30.0)
        clock.advance(4.0)
        core.handle(FirstToken(f"r{i}"))
        core.handle(RequestDone(f"r{i}", delta_gaps=(2.0, 1.0, 2.0)))
        report_load(core, "e1", token)
    placed = _placed(core, opts("next", max_tokens=100))
    assert placed.deadlines is not None
    assert placed.deadlines.first_token_seconds == pytest.approx(12.0)         # 3 x p95 4 s
    assert placed.deadlines.token_stall_seconds == pytest.approx(6.0)          # 3 x p95 2 s
    assert placed.deadlines.token_stall_p95_seconds == pytest.approx(2.0)
    assert placed.deadlines.generation_seconds == pytest.approx(120.0)         # 3 x (4 + 100 x 2) > ceiling
    state = {(d.kind, d.priority): d for d in core.state().deadlines}
    assert state[(STALL, 1)].seconds == pytest.approx(6.0) and state[(STALL, 1)].samples == 18
    core.handle(Tick())
    gauge = core.metrics.registry.get_sample_value(
        "kvmesh_scheduler_deadline_seconds", {"kind": "token_stall", "model_name": MODEL, "priority": "P1"})
    p95 = core.metrics.registry.get_sample_value(
        "kvmesh_scheduler_latency_p95_seconds", {"kind": "token_stall", "model_name": MODEL, "priority": "P1"})
    assert (gauge, p95) == (pytest.approx(6.0), pytest.approx(2.0))


def test_queue_wait_rejects_past_the_derived_bound_with_a_clear_message() -> None:
    core, clock, token = _core()
    for i in range(6):                             # six placed after a 10 s wait each: p95 10 s
        _hold(core)
        assert isinstance(admit(core, opts(f"w{i}", priority=0)), QueuedInfo)
        clock.advance(10.0)
        report_load(core, "e1", token)
        core.handle(RequestDone(f"w{i}"))
    queue_bound = core.deadlines.queue_bound(MODEL, 0, clock.monotonic())
    assert queue_bound.source is Source.DERIVED and queue_bound.seconds == pytest.approx(30.0)
    _hold(core)
    queued = admit(core, opts("late", priority=0))
    assert isinstance(queued, QueuedInfo)
    clock.advance(29.0)
    assert "late" not in dict(core.handle(Tick()).notices)
    clock.advance(1.5)                             # 30.5 s: past 3 x p95, long before the 60 s TTL
    rejected = dict(core.handle(Tick()).notices)["late"]
    assert isinstance(rejected, RejectedInfo) and rejected.reason is RejectReason.EXPIRED
    assert "queue-wait deadline, 30 s, from the p95 10 s" in rejected.message, rejected.message


def test_queue_wait_bound_is_the_ttl_with_too_few_samples() -> None:
    core, clock, _token = _core()
    _hold(core)
    admit(core, opts("late", priority=0))
    clock.advance(59.0)
    assert "late" not in dict(core.handle(Tick()).notices)
    clock.advance(1.5)
    rejected = dict(core.handle(Tick()).notices)["late"]
    assert isinstance(rejected, RejectedInfo) and "the fixed 60 s" in rejected.message


def test_queue_wait_floor_of_a_lower_class_adds_its_aging_time_to_p0() -> None:
    # Aging 30 s + 30 s (make_config's default): P1 reaches P0 after 30 s, P2 after 60 s;
    # a derived bound must leave each request that long plus P0's floor (20 s).
    book = DeadlineBook(_config())
    for cls in range(3):
        for _ in range(5):
            book.observe(QW, MODEL, cls, 0.1, 0.0)       # an idle fleet: p95 0.1 s
    assert [book.queue_bound(MODEL, c, 0.0).seconds for c in range(3)] == [20.0, 50.0, 80.0]
    assert {book.queue_bound(MODEL, c, 0.0).source for c in range(3)} == {Source.FLOOR}


def test_a_batch_line_expires_with_its_batch_and_its_wait_is_no_sample() -> None:
    book = DeadlineBook(_config())
    for _ in range(5):
        book.observe(QW, MODEL, 2, 0.1, 0.0)
    line = opts("b0", priority=2, batch=True, batch_deadline_unix=1e9)
    assert book.queue_expiry(line, 86_400.0, 0.0, 0.0) == (86_400.0, "the end of its batch's completion window")
    expiry, reason = book.queue_expiry(opts("p2", priority=2), 3600.0, 0.0, 0.0)
    assert expiry == 80.0 and "80 s" in reason
    book.queued(line, 2, 5000.0, 1.0)                    # hours behind interactive work: not P2's p95
    assert book.deadline(QW, MODEL, 2, 1.0).p95 == 0.1
