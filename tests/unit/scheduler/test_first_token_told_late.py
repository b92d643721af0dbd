"""A first token told late (`FirstToken.seconds_ago`) or folded into
`RequestDone` (scheduler.proto): the scheduler's first-token sample is dated
back to when the token came, so a gateway that saves the message teaches the
deadline book exactly what one telling it at once would."""

from __future__ import annotations

import pytest

from services.common.clock import FakeClock
from services.scheduler.core import SchedulerCore
from services.scheduler.deadlines import DeadlineKind
from services.scheduler.events import FirstToken, RequestArrived, RequestDone
from services.scheduler.records import PlacedInfo

from .helpers import MODEL, add_engine, make_config, opts, report_load


def _core() -> tuple[SchedulerCore, FakeClock, int]:
    config = make_config(queue_ttl_seconds=[60.0, 300.0, 3600.0])
    config.deadlines.min_samples = 5
    clock = FakeClock()
    core = SchedulerCore(config, clock)
    return core, clock, add_engine(core, "e1", max_running=1)


def _first_token(core: SchedulerCore, clock: FakeClock) -> tuple[float | None, int]:
    """The first-token p95 and sample count the deadline book shows."""
    [d] = [d for d in core.deadlines.states(clock.monotonic())
           if d.kind is DeadlineKind.FIRST_TOKEN and d.model == MODEL and d.priority == 1]
    return d.p95, d.samples


def _run(core: SchedulerCore, clock: FakeClock, token: int, how: str) -> None:
    """Six requests whose first token comes 2 s after placement and whose
    end comes 3 s after that, told `how`."""
    for i in range(6):
        rid = f"r{i}"
        notices = [n for r, n in core.handle(RequestArrived(opts(rid))).notices if r == rid]
        assert isinstance(notices[-1], PlacedInfo)
        clock.advance(2.0)
        if how == "at once":
            core.handle(FirstToken(rid))
        clock.advance(3.0)
        if how == "late":
            core.handle(FirstToken(rid, seconds_ago=3.0))
        core.handle(RequestDone(rid, first_token_ago=3.0 if how == "folded" else None))
        report_load(core, "e1", token)


@pytest.mark.parametrize("how", ["at once", "late", "folded"])
def test_the_first_token_sample_is_the_same_however_it_is_told(how: str) -> None:
    core, clock, token = _core()
    _run(core, clock, token, how)
    p95, samples = _first_token(core, clock)
    assert samples == 6 and p95 == pytest.approx(2.0)


def test_a_first_token_told_on_its_own_is_not_counted_again_from_done() -> None:
    core, clock, _ = _core()
    notices = [n for r, n in core.handle(RequestArrived(opts("r"))).notices if r == "r"]
    assert isinstance(notices[-1], PlacedInfo)
    clock.advance(1.0)
    core.handle(FirstToken("r"))
    clock.advance(1.0)
    core.handle(RequestDone("r", first_token_ago=0.5))
    p95, samples = _first_token(core, clock)
    assert samples == 1 and p95 == pytest.approx(1.0)
