"""n, echo and logit_bias parsing; the formatters' shapes with n choices;
the served-models listing from a scheduler state."""

from __future__ import annotations

import asyncio

import pytest

from services.common.clock import FakeClock
from services.common.openai_api.completions_output import ChatFormatter, CompletionFormatter
from services.common.openai_api.errors import ApiError
from services.common.openai_api.requests import parse_chat_body, parse_completion_body
from services.common.proto.kvmesh.v1 import scheduler_pb2
from services.gateway.events import Usage
from services.gateway.served_models import ServedModels, served_from_state

MSG = [{"role": "user", "content": "hi"}]


def test_n_echo_logit_bias_parse() -> None:
    chat = parse_chat_body({"model": "m", "messages": MSG, "n": 3, "logit_bias": {"7": -100, "9": 2.5}})
    assert chat.n == 3 and chat.sampling.logit_bias == {7: -100.0, 9: 2.5}
    assert chat.sampling.to_proto(5).logit_bias == {7: -100.0, 9: 2.5}
    completion = parse_completion_body({"model": "m", "prompt": "x", "echo": True})
    assert completion.echo and completion.n == 1


@pytest.mark.parametrize(("extra", "param"), [
    ({"n": 9}, "n"), ({"n": 0}, "n"), ({"n": True}, "n"), ({"n": 1.5}, "n"),
    ({"logit_bias": []}, "logit_bias"), ({"logit_bias": {"-1": 1}}, "logit_bias"),
    ({"logit_bias": {"1": "x"}}, "logit_bias"), ({"logit_bias": {"1": -100.5}}, "logit_bias"),
    ({"logit_bias": {"1": True}}, "logit_bias"), ({"logit_bias": {"٣": 1}}, "logit_bias"),
    ({"echo": "yes"}, "echo"), ({"echo": True, "logprobs": 2}, "echo"),
])
def test_bad_values_name_the_parameter(extra: dict, param: str) -> None:
    with pytest.raises(ApiError) as err:
        parse_completion_body({"model": "m", "prompt": "x", **extra})
    assert err.value.param == param


def test_formatters_with_n() -> None:
    chat = ChatFormatter("r", "m")
    assert chat.delta_chunk("a", index=2)["choices"][0]["index"] == 2
    assert chat.delta_sse("a", index=1) != chat.delta_sse("a")
    assert b'"index":1' in chat.delta_sse("a", index=1)
    assert chat.final_chunk("stop", 1)["choices"][0] == {"index": 1, "delta": {}, "logprobs": None,
                                                         "finish_reason": "stop"}
    body = chat.response_n([("x", (), "stop"), ("y", (), "length")], Usage(5, 4, 0))
    assert [(c["index"], c["message"]["content"], c["finish_reason"]) for c in body["choices"]] == [
        (0, "x", "stop"), (1, "y", "length")]
    assert body["usage"]["total_tokens"] == 9
    text = CompletionFormatter("r", "m").response_n([("x", (), "stop"), ("y", (), "stop")], Usage(5, 4, 0))
    assert [c["text"] for c in text["choices"]] == ["x", "y"]


def _engine(model: str, serving: bool = True, draining: bool = False, length: int = 0) -> scheduler_pb2.EngineState:
    return scheduler_pb2.EngineState(model=model, serving=serving, draining=draining, max_model_len=length)


def test_served_from_state() -> None:
    state = scheduler_pb2.SchedulerState(engines=[
        _engine("a", length=4096), _engine("a", length=2048), _engine("b", serving=False),
        _engine("c", draining=True), _engine("d")])
    served = served_from_state(state)
    assert set(served) == {"a", "d"}
    assert (served["a"].engines, served["a"].max_model_len) == (2, 2048)
    assert served["d"].max_model_len == 0
    assert served_from_state(None) == {}


def test_served_models_caches_and_filters() -> None:
    calls = []
    engines = [_engine("a"), _engine("b", length=100)]

    async def get_state() -> scheduler_pb2.SchedulerState:
        calls.append(1)
        return scheduler_pb2.SchedulerState(engines=list(engines))

    async def run() -> None:
        clock = FakeClock()
        served = ServedModels(get_state, clock, cache_seconds=1.5)
        listed = await served.listed(["a", "b", "z"], lambda n: n != "a", lambda n: 777)
        assert listed == [("b", 100, 1)]
        assert await served.listed(["a"], lambda n: True, lambda n: 777) == [("a", 777, 1)]
        assert len(calls) == 1
        engines.clear()
        clock.advance(2.0)
        assert await served.listed(["a", "b"], lambda n: True, lambda n: 1) == []
        with pytest.raises(ApiError):
            await served.require("a")
        assert len(calls) == 2

    asyncio.run(run())
