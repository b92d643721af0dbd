"""OpenAI request bodies -> one validated `GenerationInput`, or an `ApiError`
(400) naming the parameter to change.

Pure functions, no I/O. Both OpenAI front doors parse with them — the gateway
(which also maps its gRPC requests through `sampling_from_body` and
`parse_message`, services/gateway/validation.py) and an engine's own HTTP
endpoint — so a body means the same on either.

`vllm_extensions=True` also reads vLLM's sampling extensions (`min_tokens`,
`stop_token_ids`, `ignore_eos`) that load generators send straight to
engines; the gateway's HTTP API leaves it off.
"""

from __future__ import annotations

import json
import math
import reprlib
from dataclasses import dataclass, field
from typing import Any, Literal

from services.common.openai_api.choices import parse_echo, parse_logit_bias, parse_n
from services.common.openai_api.errors import ApiError, ErrorKind
from services.common.openai_api.structured_outputs import StructuredSpec, structured_from_body
from services.common.proto.kvmesh.v1 import common_pb2
from services.common.tool_calling.request import apply_tool_request, parse_message_tool_fields

__all__ = [
    "CHAT_ROLES",
    "MAX_TOP_LOGPROBS",
    "GenerationInput",
    "SamplingOptions",
    "invalid",
    "parse_chat_body",
    "parse_completion_body",
    "parse_json_body",
    "parse_message",
    "sampling_from_body",
    "show_value",
]

MAX_STOP = 4           # OpenAI's limit on stop sequences
MAX_TOP_LOGPROBS = 20  # OpenAI's limit for chat (completions: 5)
CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})

# Int32 fields of SamplingParams (top_k, min_tokens): larger values cannot be sent on.
_INT32_MAX = 2**31 - 1
_UINT32_MAX = 2**32 - 1


def show_value(value: Any) -> str:
    """A client's bad value for an error message: bounded in size and depth,
    so a 1 MB string or a 10 000-level nested list cannot blow up the error
    (or recurse)."""
    shower = reprlib.Repr()  # Python 3.11's Repr takes no keyword arguments
    shower.maxlevel, shower.maxstring, shower.maxother = 3, 80, 80
    shower.maxlist, shower.maxdict, shower.maxlong = 6, 6, 40
    return shower.repr(value)


def invalid(message: str, param: str) -> ApiError:
    return ApiError(ErrorKind.INVALID_REQUEST, message, param=param, code="invalid_value")


def _unicode(value: str, param: str) -> str:
    """JSON may carry lone surrogates ("\\ud800"), which no UTF-8 tokenizer
    (nor the engine's protobuf) can take: refuse them here, by name."""
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise invalid(f"{param} is not valid Unicode (a lone surrogate at character {exc.start}); "
                          "send UTF-8 text", param) from exc
    return value


@dataclass
class SamplingOptions:
    """Sampling as the client asked; None = engine default."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    logprobs: int | None = None  # top-N per token; 0 = only the chosen token's
    min_tokens: int = 0
    ignore_eos: bool = False
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> [-100, 100]

    def to_proto(self, max_tokens: int) -> common_pb2.SamplingParams:
        params = common_pb2.SamplingParams(
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            logit_bias=self.logit_bias,
        )
        for name in (
            "temperature", "top_p", "top_k", "min_p", "seed",
            "presence_penalty", "frequency_penalty", "repetition_penalty", "logprobs",
        ):
            value = getattr(self, name)
            if value is not None:
                setattr(params, name, value)
        return params


@dataclass
class GenerationInput:
    route: Literal["chat", "completion"]
    model: str
    sampling: SamplingOptions
    # Chat messages as the template sees them; tool fields per tool_calling/request.py.
    messages: list[dict[str, Any]] | None = None
    prompt_text: str | None = None
    prompt_ids: list[int] | None = None
    stream: bool = False
    include_usage: bool = False
    max_generation_seconds: float | None = None
    n: int = 1            # choices (services/common/openai_api/choices.py)
    echo: bool = False    # completions: the prompt's text first
    # A constraint on the output (services/common/openai_api/structured_outputs.py).
    structured: StructuredSpec | None = None
    # Tool calling (services/common/tool_calling/request.py): normalized tools,
    # "none" | "auto" | "required" | {"type": "function", "function": {"name"}}.
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] = "none"
    parallel_tool_calls: bool = True


def parse_json_body(raw: bytes) -> Any:
    """The body's JSON, or a 400 saying why it is not JSON."""
    try:
        return json.loads(raw)
    except ValueError as exc:  # also invalid UTF-8 (UnicodeDecodeError)
        raise ApiError(ErrorKind.INVALID_REQUEST, f"the body is not valid JSON: {exc}", code="invalid_json") from exc
    except RecursionError as exc:  # [[[[... deeper than the parser's stack
        raise ApiError(
            ErrorKind.INVALID_REQUEST, "the body's JSON is nested too deeply; flatten it", code="invalid_json"
        ) from exc


# ------------------------------------------------------------ scalar checks


def _number(body: dict[str, Any], name: str, lo: float, hi: float) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise invalid(f"{name} must be a number, got {show_value(value)}", name)
    try:
        number = float(value)  # an int beyond float range overflows here, not in isfinite
    except OverflowError:
        number = math.inf
    if not math.isfinite(number) or not lo <= number <= hi:
        raise invalid(f"{name} must be a number between {lo:g} and {hi:g}, got {show_value(value)}", name)
    return number


def _integer(body: dict[str, Any], name: str, lo: int, hi: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid(f"{name} must be an integer, got {show_value(value)}", name)
    if value < lo or (hi is not None and value > hi):
        bound = f"between {lo} and {hi}" if hi is not None else f">= {lo}"
        raise invalid(f"{name} must be {bound}, got {show_value(value)}", name)
    return value


def _boolean(body: dict[str, Any], name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise invalid(f"{name} must be true or false, got {show_value(value)}", name)
    return value


def _stop(body: dict[str, Any]) -> list[str]:
    value = body.get("stop")
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) and s for s in value):
        raise invalid("stop must be a non-empty string or a list of non-empty strings", "stop")
    if len(value) > MAX_STOP:
        raise invalid(f"stop may hold at most {MAX_STOP} sequences, got {len(value)}", "stop")
    return [_unicode(s, "stop") for s in value]


def _token_ids(body: dict[str, Any], name: str) -> list[int]:
    value = body.get(name)
    if value is None:
        return []
    if not isinstance(value, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= _UINT32_MAX for t in value
    ):
        raise invalid(f"{name} must be a list of token ids, got {show_value(value)}", name)
    return list(value)


def _model(body: dict[str, Any]) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError(ErrorKind.INVALID_REQUEST, "model is required: name one from GET /v1/models", param="model",
                       code="missing_required_parameter")
    return _unicode(model, "model")


def sampling_from_body(body: dict[str, Any]) -> SamplingOptions:
    """The sampling fields chat and completions share, checked against
    OpenAI's bounds (max_tokens and logprobs differ per route)."""
    top_k = _integer(body, "top_k", -1, _INT32_MAX)
    return SamplingOptions(
        temperature=_number(body, "temperature", 0.0, 2.0),
        top_p=_number(body, "top_p", 0.0, 1.0),
        # vLLM's convention: -1 or 0 = disabled.
        top_k=None if top_k is None or top_k <= 0 else top_k,
        min_p=_number(body, "min_p", 0.0, 1.0),
        seed=_integer(body, "seed", -(2**63), 2**63 - 1),
        presence_penalty=_number(body, "presence_penalty", -2.0, 2.0),
        frequency_penalty=_number(body, "frequency_penalty", -2.0, 2.0),
        repetition_penalty=_number(body, "repetition_penalty", 0.0, 2.0),
        stop=_stop(body),
        logit_bias=parse_logit_bias(body),
    )


def _vllm_sampling(body: dict[str, Any], sampling: SamplingOptions) -> None:
    sampling.min_tokens = _integer(body, "min_tokens", 0, _INT32_MAX) or 0
    sampling.stop_token_ids = _token_ids(body, "stop_token_ids")
    sampling.ignore_eos = _boolean(body, "ignore_eos")


def _stream_options(body: dict[str, Any], stream: bool) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict):
        raise invalid("stream_options must be an object", "stream_options")
    if not stream:
        raise invalid("stream_options is only allowed when stream is true", "stream_options")
    include = options.get("include_usage", False)
    if not isinstance(include, bool):
        raise invalid("stream_options.include_usage must be true or false", "stream_options.include_usage")
    return include


def _content(where: str, content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise invalid(f"{where}.content[{j}]: only text parts are supported", f"{where}.content")
            parts.append(part["text"])
        return "".join(parts)
    if not isinstance(content, str):
        raise invalid(f"{where}.content must be a string or a list of text parts", f"{where}.content")
    return content


def parse_message(i: int, raw: Any) -> dict[str, Any]:
    """messages[i] as the chat template sees it: role, content as one string
    (text parts joined), name when given, and the tool fields (tool_calling/request.py)."""
    where = f"messages[{i}]"
    if not isinstance(raw, dict):
        raise invalid(f"{where} must be an object with role and content", where)
    role = raw.get("role")
    if not isinstance(role, str) or role not in CHAT_ROLES:  # a list/dict role is unhashable
        raise invalid(f"{where}.role must be one of {sorted(CHAT_ROLES)}, got {show_value(role)}", f"{where}.role")
    content = _content(where, raw.get("content"))
    message: dict[str, Any] = {"role": role, "content": _unicode(content, f"{where}.content")}
    if isinstance(raw.get("name"), str):
        message["name"] = _unicode(raw["name"], f"{where}.name")
    parse_message_tool_fields(where, raw, message)
    return message


# ------------------------------------------------------------ HTTP bodies


def _object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise ApiError(ErrorKind.INVALID_REQUEST, "the request body must be a JSON object")
    return body


def parse_chat_body(body: Any, *, vllm_extensions: bool = False) -> GenerationInput:
    body = _object(body)
    model = _model(body)
    raw_messages = body.get("messages")
    if raw_messages is None:
        raise ApiError(ErrorKind.INVALID_REQUEST, "messages is required: a list of {role, content}",
                       param="messages", code="missing_required_parameter")
    if not isinstance(raw_messages, list) or not raw_messages:
        raise invalid("messages must be a non-empty list of {role, content}", "messages")
    messages = [parse_message(i, m) for i, m in enumerate(raw_messages)]
    sampling = sampling_from_body(body)
    max_tokens = _integer(body, "max_completion_tokens", 1)
    sampling.max_tokens = max_tokens if max_tokens is not None else _integer(body, "max_tokens", 1)
    if _boolean(body, "logprobs"):
        sampling.logprobs = _integer(body, "top_logprobs", 0, MAX_TOP_LOGPROBS) or 0
    elif body.get("top_logprobs") is not None:
        raise invalid("top_logprobs needs logprobs: true", "top_logprobs")
    if vllm_extensions:
        _vllm_sampling(body, sampling)
    stream = _boolean(body, "stream")
    generation = GenerationInput(route="chat", model=model, sampling=sampling, messages=messages, stream=stream,
                                 include_usage=_stream_options(body, stream), n=parse_n(body),
                                 structured=structured_from_body(body))
    apply_tool_request(generation, body)
    return generation


def _prompt(body: dict[str, Any]) -> tuple[str | None, list[int] | None]:
    """(text, None) or (None, ids): OpenAI's shapes, but one prompt per request."""
    prompt = body.get("prompt")
    if prompt is None:
        raise ApiError(ErrorKind.INVALID_REQUEST, "prompt is required", param="prompt",
                       code="missing_required_parameter")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise invalid("prompt must not be empty", "prompt")
        return _unicode(prompt, "prompt"), None
    if isinstance(prompt, list) and prompt and all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt
    ):
        return None, list(prompt)
    raise invalid("prompt must be one non-empty string or one list of token ids (batches are not supported)",
                  "prompt")


def _unsupported_completion_fields(body: dict[str, Any]) -> None:
    for name in ("suffix", "tools"):
        if body.get(name):
            raise ApiError(ErrorKind.INVALID_REQUEST, f"{name} is not supported", param=name,
                           code="unsupported_parameter")
    best_of = _integer(body, "best_of", 1)
    if best_of is not None and best_of > 1:
        raise ApiError(ErrorKind.INVALID_REQUEST, "best_of>1 is not supported", param="best_of",
                       code="unsupported_value")


def parse_completion_body(body: Any, *, vllm_extensions: bool = False) -> GenerationInput:
    body = _object(body)
    model = _model(body)
    text, ids = _prompt(body)
    _unsupported_completion_fields(body)
    sampling = sampling_from_body(body)
    sampling.max_tokens = _integer(body, "max_tokens", 1)
    sampling.logprobs = _integer(body, "logprobs", 0, 5)
    if vllm_extensions:
        _vllm_sampling(body, sampling)
    stream = _boolean(body, "stream")
    echo = parse_echo(body)
    if echo and sampling.logprobs is not None:
        # The engines return no prompt logprobs (README "n > 1, echo, logit_bias").
        raise ApiError(ErrorKind.INVALID_REQUEST, "echo with logprobs is not supported: the prompt's logprobs "
                       "are not computed; drop one of them", param="echo", code="unsupported_value")
    return GenerationInput(route="completion", model=model, sampling=sampling, prompt_text=text, prompt_ids=ids,
                           stream=stream, include_usage=_stream_options(body, stream), n=parse_n(body), echo=echo,
                           structured=structured_from_body(body))
