"""The soak's logic without a mesh (scripts/soak.py, scripts/soaklib/): the
slope fit and its verdicts, the accounting of answers, the batch output
check, and the fault plan's halves."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from scripts.soaklib.batches import check_output
from scripts.soaklib.faults import HALVES, FaultPlan
from scripts.soaklib.report import Result, failures
from scripts.soaklib.series import BOUNDS, Bound, Sample, Series, judge, role, slope_per_hour
from scripts.soaklib.traffic import Answer, classify, signature

FLAT = Bound(rss_mib=20.0, fds=30.0)


def _series(name: str, start: float, minutes: float, rss: float, mib_per_hour: float, fds: int = 40,
            fds_per_hour: float = 0.0, every: float = 10.0) -> Series:
    out = Series(name, 1234)
    t = start
    while t <= start + minutes * 60:
        hours = (t - start) / 3600
        out.samples.append(Sample(t, rss + mib_per_hour * hours, round(fds + fds_per_hour * hours)))
        t += every
    return out


def test_the_slope_is_per_hour_and_exact_on_a_line() -> None:
    assert slope_per_hour([(0.0, 100.0), (1800.0, 105.0), (3600.0, 110.0)]) == pytest.approx(10.0)
    assert slope_per_hour([(0.0, 5.0)]) == 0.0
    assert slope_per_hour([(7.0, 5.0), (7.0, 9.0)]) == 0.0   # no spread in time: no slope


def test_noise_around_a_flat_line_stays_far_inside_the_bound() -> None:
    rng = random.Random(3)
    series = Series("gateway-0", 1)
    for i in range(180):   # 30 min, ±2 MiB and ±4 fds of noise
        series.samples.append(Sample(i * 10.0, 150 + rng.uniform(-2, 2), 60 + rng.randrange(-4, 5)))
    v = judge(series, FLAT, warmup=600, min_span=600)
    assert v.judged and not v.over
    assert abs(v.rss_mib_per_hour) < 5 and abs(v.fds_per_hour) < 10


def test_a_leak_is_over_its_bound_and_named() -> None:
    leak = judge(_series("gateway-0", 0, 40, 150, mib_per_hour=35, fds_per_hour=50), FLAT, 600, 600)
    assert leak.judged
    assert leak.rss_mib_per_hour == pytest.approx(35, rel=0.01)
    assert leak.over == ["RSS +35.0 MiB/h > 20", "fds +50.0/h > 30"]


def test_the_warm_up_counts_from_each_process_start() -> None:
    # Fast growth in a fresh process's first minutes is not fitted.
    series = _series("engine-1", 1200, 10, 100, mib_per_hour=600)          # minutes 20-30: growing
    series.samples += _series("engine-1", 1810, 30, 200, 0).samples       # then flat
    v = judge(series, FLAT, warmup=600, min_span=600)
    assert v.fit_from == 1800 and v.judged and not v.over
    # Fitted from its start, the same process would be over its bound.
    assert judge(series, FLAT, warmup=0, min_span=600).over


def test_a_series_too_short_after_its_warm_up_is_not_judged() -> None:
    v = judge(_series("gateway-1", 1200, 14, 150, mib_per_hour=500), FLAT, warmup=600, min_span=600)
    assert not v.judged and v.over == []   # 4 minutes after its warm-up: reported, not judged
    empty = judge(Series("batch", 9), FLAT, 600, 600)
    assert not empty.judged and empty.fitted == 0


def test_every_service_has_a_bound() -> None:
    for name in ("scheduler", "engine-0", "engine-1", "gateway-0", "gateway-1", "batch", "envoy", "redis"):
        assert role(name) in BOUNDS


def _chat(content: str | None, finish: str = "stop", calls: list[tuple[str, str]] | None = None) -> dict[str, Any]:
    tool_calls = [{"id": "call_x", "type": "function", "function": {"name": n, "arguments": a}}
                  for n, a in calls or []]
    return {"choices": [{"message": {"role": "assistant", "content": content, "tool_calls": tool_calls},
                         "finish_reason": finish}]}


def test_an_answer_counts_only_when_it_is_the_uninterrupted_one() -> None:
    path = "/v1/chat/completions"
    expected = signature(path, _chat("Paris is the capital"))
    assert classify(Answer(200, expected), expected) == ("ok", "")
    assert classify(Answer(200, signature(path, _chat("Paris is the capital", "length"))), expected)[0] == "lost"
    call = signature(path, _chat(None, "tool_calls", [("get_weather", '{"city": "sim"}')]))
    assert call != signature(path, _chat(None, "tool_calls", [("get_weather", '{"city": "si"}')]))
    # The random call id is not part of it.
    assert call == signature(path, {"choices": [{"message": {"content": None, "tool_calls": [
        {"id": "call_y", "function": {"name": "get_weather", "arguments": '{"city": "sim"}'}}]},
        "finish_reason": "tool_calls"}]})
    responses = {"id": "resp_1", "status": "incomplete", "output": [
        {"type": "message", "content": [{"type": "output_text", "text": "a"}, {"type": "output_text", "text": "b"}]}]}
    assert json.loads(signature("/v1/responses", responses)) == ["ab", "incomplete"]


@pytest.mark.parametrize(("answer", "kind", "reason"), [
    (Answer(429, error=json.dumps({"error": {"code": "queue_full", "message": "full"}})), "rejected",
     "http 429 queue_full: full"),
    (Answer(503, error=json.dumps({"error": {"code": "no_engine", "message": "none"}})), "rejected",
     "http 503 no_engine: none"),
    # A stored response the mesh promised to keep and did not: lost, though the answer is definite.
    (Answer(404, error=json.dumps({"error": {"code": "response_not_found", "message": "gone"}})), "lost",
     "http 404 response_not_found"),
    (Answer(503, error="upstream connect error"), "lost", "http 503 without an error body"),
    (Answer(0, error="ServerDisconnectedError: cut"), "lost", "ServerDisconnectedError: cut"),
])
def test_refusals_are_definite_answers_and_everything_else_is_lost(answer: Answer, kind: str, reason: str) -> None:
    assert classify(answer, "x") == (kind, reason)


def _line(custom_id: str, status: int = 200) -> dict[str, object]:
    return {"custom_id": custom_id, "response": {"status_code": status, "body": {"choices": [{"message": {}}]}}}


def test_a_batch_counts_each_line_once_with_a_200() -> None:
    assert check_output([_line(f"b-{i}") for i in range(3)], "b", 3) == (3, {})
    ok, wrong = check_output([_line("b-0"), _line("b-0"), _line("b-1", 500)], "b", 3)
    assert ok == 0
    assert wrong == {"custom_id more than once in the output": 2, "line without a 200 answer": 1,
                     "line missing from the output": 1}


def test_the_plan_draws_every_kind_of_a_half_before_repeating() -> None:
    plan = FaultPlan(random.Random(5), duration=3600, every=(60, 120))
    first = [plan.pick(100.0) for _ in HALVES[0]]
    assert sorted(first, key=str) == sorted(HALVES[0], key=str)
    second = [plan.pick(2000.0) for _ in range(2 * len(HALVES[1]))]
    assert sorted(second, key=str) == sorted(HALVES[1] * 2, key=str)
    assert all(60 <= plan.gap() <= 120 for _ in range(50))
    # The halves spare one of each kind of service.
    kinds = {k for half in HALVES for k, _ in half}
    assert kinds == {"engine-kill", "scheduler-kill", "gateway-kill", "hang", "gateway-roll", "batch-kill"}
    assert ("scheduler-kill", None) not in HALVES[1] and ("batch-kill", None) not in HALVES[0]
    assert ("gateway-roll", None) not in HALVES[1]
    assert all(victim != "gateway-0" for half in HALVES for _, victim in half)


def test_the_soak_fails_on_a_loss_or_a_slope_over_its_bound() -> None:
    from scripts.chaoslib.outcomes import Tally
    from scripts.soaklib.batches import BatchTally

    flat = judge(_series("envoy", 0, 40, 30, 1), FLAT, 600, 600)
    result = Result(ns={}, took=60, tallies={"chat": Tally(sent=3, completed=3)}, batch=BatchTally(),
                    faults=Tally(), made=[], fault_loop_failed="", verdicts=[flat])
    assert failures(result) == []
    result.tallies["chat"].lost["cut"] += 1
    result.verdicts.append(judge(_series("redis", 0, 40, 30, 25), FLAT, 600, 600))
    assert failures(result) == ["1 requests lost", "redis (pid 1234): RSS +25.0 MiB/h > 20"]


def test_a_baseline_that_is_not_what_was_asked_for_stops_the_soak() -> None:
    from scripts.soaklib.traffic import check_shapes

    good_call = json.dumps([None, [["get_weather", '{"city": "sim"}']], "tool_calls"])
    check_shapes(['{"name": "sim", "age": 18, "tags": ["sim", "sim"]}'], [good_call])
    with pytest.raises(SystemExit, match="structured"):
        check_shapes(['{"name": "sim", "age": 17, "tags": ["sim", "sim"]}'], [])
    with pytest.raises(SystemExit, match="tool-call"):
        check_shapes([], [json.dumps([None, [["get_weather", '{"city": "s"}']], "tool_calls"])])
    with pytest.raises(SystemExit, match="tool-call"):
        check_shapes([], [json.dumps(["Paris", [], "stop"])])


def test_the_soaks_redis_starts_answers_and_is_ended(tmp_path: Path) -> None:
    import shutil

    import redis

    from scripts.soaklib.redis_store import redis_server

    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (scripts/install/system-packages.sh, test profile)")
    with redis_server(tmp_path) as server:
        client = redis.Redis.from_url(server.url)
        assert client.set("soak", "1") and client.get("soak") == b"1"
        client.close()
    assert server.process.returncode is not None


def test_the_json_result_holds_the_verdict_and_the_raw_samples(tmp_path: Path) -> None:
    from scripts.chaoslib.outcomes import Tally
    from scripts.soaklib.batches import BatchTally
    from scripts.soaklib.report import report

    series = _series("scheduler", 0, 30, 60, 2)
    result = Result(ns={"minutes": 30}, took=1800, tallies={"chat": Tally(sent=2, completed=2)}, batch=BatchTally(),
                    faults=Tally(), made=["hang"], fault_loop_failed="",
                    verdicts=[judge(series, FLAT, 600, 600)], series=[series])
    assert report(result, tmp_path / "soak.json") == 0
    data = json.loads((tmp_path / "soak.json").read_text())
    assert data["passed"] and data["totals"]["completed"] == 2 and data["faults"]["made"] == {"hang": 1}
    assert data["resources"][0]["judged"] and data["resources"][0]["over"] == []
    assert len(data["samples"]["scheduler 1234"]) == len(series.samples)
