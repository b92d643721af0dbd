"""A batch's input file, line by line (services/batch/inputs.py),
the output line shape (output.py) and the runner's pacing window
(pacing.py, on a fake clock's times)."""

from __future__ import annotations

import json

import pytest

from services.batch.inputs import check_input
from services.batch.output import files_of, not_run_line, response_line
from services.batch.pacing import Pace, Window
from services.batch.submit import pace_of

CHAT = "/v1/chat/completions"


def _line(custom_id: object = "a", url: str = CHAT, method: str = "POST", model: str = "m", **body: object) -> str:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], **body}
    return json.dumps({"custom_id": custom_id, "method": method, "url": url, "body": body})


@pytest.mark.parametrize(("lines", "code", "param"), [
    (["{not json"], "invalid_json_line", None),
    (["[1, 2]"], "invalid_json_line", None),
    ([_line(custom_id="")], "missing_required_parameter", "custom_id"),
    ([_line(custom_id=7)], "missing_required_parameter", "custom_id"),
    ([_line("a"), _line("a")], "duplicate_custom_id", "custom_id"),
    ([_line(method="GET")], "invalid_method", "method"),
    ([_line(url="/v1/completions")], "invalid_url", "url"),
    ([json.dumps({"custom_id": "a", "method": "POST", "url": CHAT, "body": "x"})], "missing_required_parameter",
     "body"),
    ([_line(model="")], "missing_required_parameter", "body.model"),
    ([_line("a"), _line("b", model="other")], "model_mismatch", "body.model"),
])
def test_a_malformed_line_fails_the_batch(lines: list[str], code: str, param: str | None) -> None:
    checked = check_input("\n".join(lines).encode(), CHAT, 100)
    assert [(e["code"], e["param"]) for e in checked.errors] == [(code, param)]
    assert checked.errors[0]["line"] == len(lines)


def test_file_level_errors() -> None:
    assert check_input(b"\n\n", CHAT, 10).errors[0]["code"] == "empty_file"
    assert check_input(b"\xff\xfe", CHAT, 10).errors[0]["code"] == "invalid_file_format"
    many = "\n".join(_line(f"c{i}") for i in range(4)).encode()
    assert check_input(many, CHAT, 3).errors[0]["code"] == "too_many_requests"
    assert not check_input(many, CHAT, 4).errors


def test_an_invalid_body_fails_only_its_line_with_a_400() -> None:
    text = "\n".join([_line("ok"), "", _line("bad", messages=[]), _line("streamed", stream=True)])
    checked = check_input(text.encode(), CHAT, 10)
    assert not checked.errors and checked.model == "m"
    assert [(cid, out is None) for cid, _, out in checked.lines] == [("ok", True), ("bad", False),
                                                                     ("streamed", False)]
    bad = json.loads(checked.lines[1][2] or "")
    assert bad["response"]["status_code"] == 400 and bad["response"]["body"]["error"]["param"] == "messages"
    assert json.loads(checked.lines[2][2] or "")["response"]["body"]["error"]["param"] == "stream"


def test_output_lines_have_openais_shape() -> None:
    ok = json.loads(response_line("c1", "req-1", 200, {"object": "chat.completion"}))
    assert set(ok) == {"id", "custom_id", "response", "error"} and ok["id"].startswith("batch_req_")
    assert ok["response"] == {"status_code": 200, "request_id": "req-1", "body": {"object": "chat.completion"}}
    assert ok["error"] is None
    expired = json.loads(not_run_line("c2", "expired"))
    assert expired["response"] is None and expired["error"]["code"] == "batch_expired"
    files = dict(files_of([("c1", response_line("c1", "r", 200, {}), True)], "completed"))
    assert set(files) == {"output_file_id"}  # no error file when nothing failed
    assert files_of([], "completed") == []


def test_pacing_window_grows_when_placed_and_backs_off_on_rejections() -> None:
    window = Window(limit_max=8, limit=2.0)
    for _ in range(40):
        window.observe(Pace.PLACED, now=0.0)
    assert window.size == 8  # capped at max_in_flight
    window.observe(Pace.QUEUED, now=0.0)
    assert window.size == 7  # lines wait in the queue: one fewer
    window.observe(Pace.REJECTED, now=10.0)
    assert window.size == 3 and window.wait_seconds(10.0) == pytest.approx(0.25)
    window.observe(Pace.REJECTED, now=10.1)
    assert window.size == 1 and window.wait_seconds(10.1) == pytest.approx(0.5)
    for t in range(10):
        window.observe(Pace.REJECTED, now=20.0 + t)
    assert window.size == 1 and window.backoff == 10.0  # bounded
    assert window.wait_seconds(40.0) == 0.0
    window.observe(Pace.PLACED, now=40.0)
    assert window.backoff == 0.0 and window.size == 2
    window.observe(Pace.NEUTRAL, now=40.0)
    assert window.size == 2


@pytest.mark.parametrize(("queued", "wait", "run", "pace"), [
    (False, 0.0, 1.0, Pace.PLACED),
    (True, 0.8, 1.0, Pace.PLACED),    # a backlog no longer than the run: keep (and grow) the window
    (True, 2.0, 1.0, Pace.QUEUED),    # waited longer than it ran: the runner sends too much
    (True, 0.2, 0.05, Pace.PLACED),   # short waits are no signal whatever the line's length
])
def test_a_lines_queue_wait_against_its_run_time_is_the_signal(queued: bool, wait: float, run: float,
                                                                 pace: Pace) -> None:
    assert pace_of(queued, wait, run) is pace


def test_pacing_window_slow_starts_to_fill_a_fresh_fleet_in_a_few_line_times() -> None:
    # A fleet of 16 free slots, lines placed at once: each "round" every line
    # in flight finishes PLACED (one line run time). Additive increase alone
    # took 12 rounds (~70 s at 6 s a line, BENCHMARKS.md); slow start doubles.
    window, rounds = Window(limit_max=32), 0
    while window.size < 16:
        for _ in range(window.size):
            window.observe(Pace.PLACED, now=float(rounds))
        rounds += 1
    assert rounds == 2 and window.size == 16  # 4 -> 8 -> 16
    window.observe(Pace.QUEUED, now=2.0)  # the fleet is full: slow start ends
    assert window.size == 15 and window.threshold == 15.0
    for _ in range(14):
        window.observe(Pace.PLACED, now=3.0)
    assert window.size == 15
    window.observe(Pace.PLACED, now=3.0)
    window.observe(Pace.PLACED, now=3.0)
    assert window.size == 16  # then one line per window's worth of placed lines


def test_pacing_window_after_a_rejection_grows_additively() -> None:
    window = Window(limit_max=32, limit=16.0)
    window.observe(Pace.REJECTED, now=0.0)
    assert window.size == 8
    for _ in range(8):
        window.observe(Pace.PLACED, now=1.0)
    assert window.size == 9  # no second slow start right after the fleet refused lines
