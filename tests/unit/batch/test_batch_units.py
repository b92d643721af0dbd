"""The batch service's modules: each states its public surface, and the
line executor turns each gateway answer into the right outcome."""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
from types import SimpleNamespace

import pytest

import services.batch
from services.batch.pacing import Pace
from services.batch.submit import LINE_HEADERS, Attempt, LineExecutor, Outcome, _broken, _refused


def test_every_module_states_its_public_surface() -> None:
    names = [info.name for info in pkgutil.iter_modules(services.batch.__path__)]
    assert "submit" in names and "server" in names
    for name in names:
        module = importlib.import_module(f"services.batch.{name}")
        missing = [symbol for symbol in module.__all__ if not hasattr(module, symbol)]
        assert module.__all__ and not missing, (name, missing)


def _attempt(resume: bool = False, n: int = 1) -> Attempt:
    return Attempt("/v1/chat/completions", {"model": "m", "n": n}, "c1", "b-1-1", 1.0, resume)


@pytest.mark.parametrize(("status", "code", "resume", "outcome", "pace"), [
    (404, "resume_not_found", True, Outcome.RERUN, Pace.NEUTRAL),     # the kept generation is gone
    (409, "resume_gap", True, Outcome.RERUN, Pace.NEUTRAL),
    (404, "resume_not_found", False, Outcome.DONE, Pace.NEUTRAL),     # not a resume: the line's own answer
    (409, "duplicate_request_id", False, Outcome.RESUME, Pace.NEUTRAL),  # an earlier send of it runs: re-attach
    (429, "rate_limit_exceeded", False, Outcome.RETRY, Pace.REJECTED),  # waited out, window halves
    (503, "no_engine", False, Outcome.RETRY, Pace.REJECTED),
    (502, "error", False, Outcome.RETRY, Pace.NEUTRAL),                # a failed generation: tried again
    (504, "timeout", False, Outcome.DONE, Pace.NEUTRAL),               # its own limit: the next try ends so too
    (400, None, False, Outcome.DONE, Pace.NEUTRAL),
    (403, "model_not_allowed", False, Outcome.DONE, Pace.NEUTRAL),
    (409, "batch_lease_expired", False, Outcome.FENCED, Pace.NEUTRAL),  # sent after our lease ran out
    (409, "batch_lease_expired", True, Outcome.FENCED, Pace.NEUTRAL),
])
def test_a_refusal_becomes_its_outcome(status: int, code: str | None, resume: bool, outcome: Outcome,
                                       pace: Pace) -> None:
    result = _refused(_attempt(resume), status, {"error": {"message": "m", "code": code}})
    assert (result.outcome, result.pace) == (outcome, pace)
    if outcome is Outcome.DONE:
        assert f'"status_code":{status}' in result.output and '"custom_id":"c1"' in result.output


def test_a_broken_connection_resumes_only_what_can_be_resumed() -> None:
    import aiohttp

    cut = aiohttp.ServerDisconnectedError()
    assert _broken(_attempt(), cut).outcome is Outcome.RESUME
    assert _broken(_attempt(n=2), cut).outcome is Outcome.RETRY        # n > 1 is not resumable
    key = SimpleNamespace(host="127.0.0.1", port=1, ssl=None, is_ssl=False)
    refused = aiohttp.ClientConnectorError(key, ConnectionRefusedError(111, "refused"))  # type: ignore[arg-type]  # a stand-in ConnectionKey: only host/port/ssl are read
    assert (_broken(_attempt(), refused).outcome, _broken(_attempt(), refused).pace) == (Outcome.RETRY,
                                                                                         Pace.REJECTED)


def test_a_send_carries_its_admit_by_time() -> None:
    """The gateway's half of the ownership fence reads it (ownership.py)."""
    executor = LineExecutor("http://gw", "secret")
    fenced = dataclasses.replace(_attempt(), admit_by_unix=1234.5)
    assert executor.headers(fenced, "k")[LINE_HEADERS["admit_by"]] == "1234.500"
    assert LINE_HEADERS["admit_by"] not in executor.headers(_attempt(), "k")
