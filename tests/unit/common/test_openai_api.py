"""The OpenAI surface both front doors share: request parsing, response
shapes and error JSON (services/common/openai_api/)."""

from __future__ import annotations

import importlib
import json

import pytest

from services.common.openai_api.completions_output import ChatFormatter, CompletionFormatter, sse
from services.common.openai_api.errors import ApiError, ErrorKind, error_body, http_error
from services.common.openai_api.requests import parse_chat_body, parse_completion_body, parse_json_body
from services.common.proto.kvmesh.v1 import common_pb2


@pytest.mark.parametrize("name", ["errors", "requests", "completions_output", "responses_events", "structured_outputs"])
def test_public_surface(name: str) -> None:
    module = importlib.import_module(f"services.common.openai_api.{name}")
    assert module.__all__, name
    for symbol in module.__all__:
        assert hasattr(module, symbol), f"{name}.{symbol}"


MSG = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": MSG}, "model"),
        ({"model": "m"}, "messages"),
        ({"model": "m", "messages": []}, "messages"),
        ({"model": "m", "messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        ({"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
         "messages[0].content"),
        ({"model": "m", "messages": MSG, "temperature": -1}, "temperature"),
        ({"model": "m", "messages": MSG, "top_p": 2}, "top_p"),
        ({"model": "m", "messages": MSG, "max_tokens": 0}, "max_tokens"),
        ({"model": "m", "messages": MSG, "max_tokens": "5"}, "max_tokens"),
        ({"model": "m", "messages": MSG, "presence_penalty": 3}, "presence_penalty"),
        ({"model": "m", "messages": MSG, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"model": "m", "messages": MSG, "n": 9}, "n"),
        ({"model": "m", "messages": MSG, "logprobs": True, "top_logprobs": 50}, "top_logprobs"),
        ({"model": "m", "messages": MSG, "stream_options": {"include_usage": True}}, "stream_options"),
        ({"model": "m", "messages": MSG, "tools": [{"type": "function"}]}, "tools[0].function"),
    ],
)
def test_chat_validation_names_the_parameter(body: dict, param: str) -> None:
    with pytest.raises(ApiError) as err:
        parse_chat_body(body)
    assert err.value.kind is ErrorKind.INVALID_REQUEST and err.value.param == param


def test_valid_bodies() -> None:
    chat = parse_chat_body({"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                                      {"type": "text", "text": "b"}]}],
                            "max_completion_tokens": 5, "top_k": -1, "stop": "x", "n": 1})
    assert chat.messages == [{"role": "user", "content": "ab"}]
    assert chat.sampling.max_tokens == 5 and chat.sampling.top_k is None and chat.sampling.stop == ["x"]
    comp = parse_completion_body({"model": "m", "prompt": [[1, 2, 3]], "logprobs": 2})
    assert comp.prompt_ids == [1, 2, 3] and comp.sampling.logprobs == 2
    with pytest.raises(ApiError, match="batches"):
        parse_completion_body({"model": "m", "prompt": ["a", "b"]})


def test_vllm_extensions_only_when_asked() -> None:
    body = {"model": "m", "prompt": "x", "min_tokens": 3, "stop_token_ids": [7, 8], "ignore_eos": True}
    plain = parse_completion_body(body).sampling
    assert (plain.min_tokens, plain.stop_token_ids, plain.ignore_eos) == (0, [], False)
    extended = parse_completion_body(body, vllm_extensions=True).sampling
    assert (extended.min_tokens, extended.stop_token_ids, extended.ignore_eos) == (3, [7, 8], True)
    chat = parse_chat_body({"model": "m", "messages": MSG, "ignore_eos": True}, vllm_extensions=True)
    assert chat.sampling.ignore_eos
    for bad, param in [({"min_tokens": -1}, "min_tokens"), ({"stop_token_ids": [-1]}, "stop_token_ids"),
                       ({"ignore_eos": "yes"}, "ignore_eos")]:
        with pytest.raises(ApiError) as err:
            parse_completion_body({**body, **bad}, vllm_extensions=True)
        assert err.value.param == param


@pytest.mark.parametrize("raw", [b"not json", b"[" * 100_000, b"\xff\xfe"])
def test_body_that_is_not_json_is_a_400(raw: bytes) -> None:
    with pytest.raises(ApiError) as err:
        parse_json_body(raw)
    assert err.value.kind is ErrorKind.INVALID_REQUEST and err.value.code == "invalid_json"


def test_error_json_shape_and_retry_after() -> None:
    exc = ApiError(ErrorKind.OVERLOADED, "full", param="x", retry_after=0.2)
    assert error_body(exc) == {"error": {"message": "full", "type": "rate_limit_error", "param": "x",
                                         "code": "overloaded"}}
    mapped = http_error(exc)
    assert mapped.status == 429 and mapped.headers == {"Retry-After": "1"}


class _Usage:
    prompt_tokens, completion_tokens, cached_tokens = 5, 2, 4


def test_delta_fast_path_is_byte_identical_to_the_full_chunk() -> None:
    for cls in (ChatFormatter, CompletionFormatter):
        formatter = cls("r1", "m", include_usage=True)
        for text in ["", "plain", 'quote " and \\ slash', "ünï ✓\n"]:
            assert formatter.delta_sse(text) == sse(formatter.delta_chunk(text))


def test_token_ids_extension_and_shapes() -> None:
    chat = ChatFormatter("r1", "m", token_ids=True)
    chunk = json.loads(chat.delta_sse("a", (), [5, 6])[6:])
    assert chunk["object"] == "chat.completion.chunk" and chunk["choices"][0]["token_ids"] == [5, 6]
    whole = chat.response("ab", (), "length", _Usage(), [5, 6])
    assert whole["id"] == "chatcmpl-r1" and whole["choices"][0]["message"]["content"] == "ab"
    assert whole["choices"][0]["token_ids"] == [5, 6] and whole["choices"][0]["finish_reason"] == "length"
    assert whole["usage"] == {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7,
                              "prompt_tokens_details": {"cached_tokens": 4}}
    plain = CompletionFormatter("r2", "m").response("t", (), "stop", _Usage())
    assert "token_ids" not in plain["choices"][0] and plain["object"] == "text_completion"


def test_completion_logprobs_offsets_run_on_across_chunks() -> None:
    formatter = CompletionFormatter("r", "m")
    items = [common_pb2.TokenLogprob(token="ab", logprob=-0.5), common_pb2.TokenLogprob(token="c", logprob=-1.0)]
    first = formatter.delta_chunk("abc", items)["choices"][0]["logprobs"]
    second = formatter.delta_chunk("ab", items[:1])["choices"][0]["logprobs"]
    assert first["text_offset"] == [0, 2] and second["text_offset"] == [3]
