"""Turn what a client sent (OpenAI JSON or Inference protos) into one
validated `GenerationInput`, or a 400 naming the parameter to change.

Pure functions, no I/O: the same rules serve HTTP and gRPC.
"""

from __future__ import annotations

import math
import reprlib
from dataclasses import dataclass, field
from typing import Any, Literal

from services.common.proto.kvmesh.v1 import common_pb2, inference_pb2
from services.gateway.errors import ErrorKind, GatewayError

__all__ = [
    "GenerationInput",
    "SamplingOptions",
    "chat_from_proto",
    "generate_from_proto",
    "parse_chat_body",
    "parse_completion_body",
    "parse_priority_header",
    "priority_from_proto",
    "priority_to_proto",
]

MAX_STOP = 4           # OpenAI's limit on stop sequences
MAX_TOP_LOGPROBS = 20  # OpenAI's limit for chat (completions: 5)
CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})


# Int32 fields of SamplingParams (top_k): larger values cannot be sent on.
_INT32_MAX = 2**31 - 1

# Echoing a client's bad value: bounded in size and depth, so a 1 MB string
# or a 10 000-level nested list cannot blow up the error (or recurse).
def _show(value: Any) -> str:
    shower = reprlib.Repr()  # Python 3.11's Repr takes no keyword arguments
    shower.maxlevel, shower.maxstring, shower.maxother = 3, 80, 80
    shower.maxlist, shower.maxdict, shower.maxlong = 6, 6, 40
    return shower.repr(value)


def _bad(message: str, param: str) -> GatewayError:
    return GatewayError(ErrorKind.INVALID_REQUEST, message, param=param, code="invalid_value")


def _unicode(value: str, param: str) -> str:
    """JSON may carry lone surrogates ("\\ud800"), which no UTF-8 tokenizer
    (nor the engine's protobuf) can take: refuse them here, by name."""
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise _bad(f"{param} is not valid Unicode (a lone surrogate at character {exc.start}); "
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

    def to_proto(self, max_tokens: int) -> common_pb2.SamplingParams:
        params = common_pb2.SamplingParams(
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
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
    messages: list[dict[str, str]] | None = None
    prompt_text: str | None = None
    prompt_ids: list[int] | None = None
    stream: bool = False
    include_usage: bool = False
    max_generation_seconds: float | None = None


# ------------------------------------------------------------ scalar checks


def _number(body: dict[str, Any], name: str, lo: float, hi: float) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _bad(f"{name} must be a number, got {_show(value)}", name)
    try:
        number = float(value)  # an int beyond float range overflows here, not in isfinite
    except OverflowError:
        number = math.inf
    if not math.isfinite(number) or not lo <= number <= hi:
        raise _bad(f"{name} must be a number between {lo:g} and {hi:g}, got {_show(value)}", name)
    return number


def _integer(body: dict[str, Any], name: str, lo: int, hi: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(f"{name} must be an integer, got {_show(value)}", name)
    if value < lo or (hi is not None and value > hi):
        bound = f"between {lo} and {hi}" if hi is not None else f">= {lo}"
        raise _bad(f"{name} must be {bound}, got {_show(value)}", name)
    return value


def _boolean(body: dict[str, Any], name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise _bad(f"{name} must be true or false, got {_show(value)}", name)
    return value


def _stop(body: dict[str, Any]) -> list[str]:
    value = body.get("stop")
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) and s for s in value):
        raise _bad("stop must be a non-empty string or a list of non-empty strings", "stop")
    if len(value) > MAX_STOP:
        raise _bad(f"stop may hold at most {MAX_STOP} sequences, got {len(value)}", "stop")
    return [_unicode(s, "stop") for s in value]


def _model(body: dict[str, Any]) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise GatewayError(ErrorKind.INVALID_REQUEST, "model is required: name one from GET /v1/models", param="model",
                           code="missing_required_parameter")
    return _unicode(model, "model")


def _common(body: dict[str, Any]) -> SamplingOptions:
    n = _integer(body, "n", 1)
    if n is not None and n > 1:
        raise GatewayError(ErrorKind.INVALID_REQUEST, "n>1 is not supported; send n separate requests", param="n",
                           code="unsupported_value")
    for name in ("tools", "functions"):
        if body.get(name):
            raise GatewayError(ErrorKind.INVALID_REQUEST, f"{name} are not supported by this server", param=name,
                               code="unsupported_parameter")
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
    )


def _stream_options(body: dict[str, Any], stream: bool) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict):
        raise _bad("stream_options must be an object", "stream_options")
    if not stream:
        raise _bad("stream_options is only allowed when stream is true", "stream_options")
    include = options.get("include_usage", False)
    if not isinstance(include, bool):
        raise _bad("stream_options.include_usage must be true or false", "stream_options.include_usage")
    return include


def _message(i: int, raw: Any) -> dict[str, str]:
    where = f"messages[{i}]"
    if not isinstance(raw, dict):
        raise _bad(f"{where} must be an object with role and content", where)
    role = raw.get("role")
    if not isinstance(role, str) or role not in CHAT_ROLES:  # a list/dict role is unhashable
        raise _bad(f"{where}.role must be one of {sorted(CHAT_ROLES)}, got {_show(role)}", f"{where}.role")
    content = raw.get("content")
    if content is None:
        content = ""
    elif isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise _bad(f"{where}.content[{j}]: only text parts are supported", f"{where}.content")
            parts.append(part["text"])
        content = "".join(parts)
    elif not isinstance(content, str):
        raise _bad(f"{where}.content must be a string or a list of text parts", f"{where}.content")
    message = {"role": role, "content": _unicode(content, f"{where}.content")}
    if isinstance(raw.get("name"), str):
        message["name"] = _unicode(raw["name"], f"{where}.name")
    return message


# ------------------------------------------------------------ HTTP bodies


def parse_chat_body(body: Any) -> GenerationInput:
    if not isinstance(body, dict):
        raise GatewayError(ErrorKind.INVALID_REQUEST, "the request body must be a JSON object")
    model = _model(body)
    raw_messages = body.get("messages")
    if raw_messages is None:
        raise GatewayError(ErrorKind.INVALID_REQUEST, "messages is required: a list of {role, content}",
                           param="messages", code="missing_required_parameter")
    if not isinstance(raw_messages, list) or not raw_messages:
        raise _bad("messages must be a non-empty list of {role, content}", "messages")
    messages = [_message(i, m) for i, m in enumerate(raw_messages)]
    sampling = _common(body)
    max_tokens = _integer(body, "max_completion_tokens", 1)
    sampling.max_tokens = max_tokens if max_tokens is not None else _integer(body, "max_tokens", 1)
    if _boolean(body, "logprobs"):
        sampling.logprobs = _integer(body, "top_logprobs", 0, MAX_TOP_LOGPROBS) or 0
    elif body.get("top_logprobs") is not None:
        raise _bad("top_logprobs needs logprobs: true", "top_logprobs")
    response_format = body.get("response_format")
    if isinstance(response_format, dict) and response_format.get("type", "text") != "text":
        raise GatewayError(ErrorKind.INVALID_REQUEST, "only response_format type 'text' is supported",
                           param="response_format", code="unsupported_value")
    stream = _boolean(body, "stream")
    return GenerationInput(
        route="chat",
        model=model,
        sampling=sampling,
        messages=messages,
        stream=stream,
        include_usage=_stream_options(body, stream),
    )


def parse_completion_body(body: Any) -> GenerationInput:
    if not isinstance(body, dict):
        raise GatewayError(ErrorKind.INVALID_REQUEST, "the request body must be a JSON object")
    model = _model(body)
    prompt = body.get("prompt")
    text: str | None = None
    ids: list[int] | None = None
    if prompt is None:
        raise GatewayError(ErrorKind.INVALID_REQUEST, "prompt is required", param="prompt",
                           code="missing_required_parameter")
    # Accept OpenAI's shapes, but only one prompt per request.
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise _bad("prompt must not be empty", "prompt")
        text = _unicode(prompt, "prompt")
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                     for t in prompt):
        ids = list(prompt)
    else:
        raise _bad("prompt must be one non-empty string or one list of token ids (batches are not supported)",
                   "prompt")
    if body.get("echo"):
        raise GatewayError(ErrorKind.INVALID_REQUEST, "echo is not supported", param="echo",
                           code="unsupported_parameter")
    if body.get("suffix"):
        raise GatewayError(ErrorKind.INVALID_REQUEST, "suffix is not supported", param="suffix",
                           code="unsupported_parameter")
    best_of = _integer(body, "best_of", 1)
    if best_of is not None and best_of > 1:
        raise GatewayError(ErrorKind.INVALID_REQUEST, "best_of>1 is not supported", param="best_of",
                           code="unsupported_value")
    sampling = _common(body)
    sampling.max_tokens = _integer(body, "max_tokens", 1)
    sampling.logprobs = _integer(body, "logprobs", 0, 5)
    stream = _boolean(body, "stream")
    return GenerationInput(
        route="completion",
        model=model,
        sampling=sampling,
        prompt_text=text,
        prompt_ids=ids,
        stream=stream,
        include_usage=_stream_options(body, stream),
    )


def parse_priority_header(value: str | None) -> int:
    """`X-Priority: 0|1|2` (also P0/P1/P2); absent = P1."""
    if value is None or value.strip() == "":
        return 1
    raw = value.strip().upper().removeprefix("P")
    if raw not in ("0", "1", "2"):
        raise GatewayError(ErrorKind.INVALID_REQUEST, f"X-Priority must be 0, 1 or 2, got {_show(value)}",
                           param="X-Priority", code="invalid_value")
    return int(raw)


# ------------------------------------------------------------ gRPC messages

_PRIORITY = {
    inference_pb2.PRIORITY_UNSPECIFIED: 1,
    inference_pb2.PRIORITY_P0: 0,
    inference_pb2.PRIORITY_P1: 1,
    inference_pb2.PRIORITY_P2: 2,
}


def priority_from_proto(value: int) -> int:
    if value not in _PRIORITY:
        raise _bad(f"priority must be PRIORITY_P0, PRIORITY_P1 or PRIORITY_P2, got {value}", "priority")
    return _PRIORITY[value]


def priority_to_proto(value: int) -> int:
    return {0: inference_pb2.PRIORITY_P0, 1: inference_pb2.PRIORITY_P1, 2: inference_pb2.PRIORITY_P2}.get(
        value, inference_pb2.PRIORITY_UNSPECIFIED
    )


def _sampling_from_proto(params: common_pb2.SamplingParams) -> SamplingOptions:
    """Same bounds as HTTP: route the proto through the dict checks."""
    body: dict[str, Any] = {}
    for name in ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
                 "repetition_penalty"):
        if params.HasField(name):
            body[name] = getattr(params, name)
    if params.stop:
        body["stop"] = list(params.stop)
    options = _common(body)
    options.max_tokens = params.max_tokens or None
    options.min_tokens = params.min_tokens
    options.stop_token_ids = list(params.stop_token_ids)
    options.ignore_eos = params.ignore_eos
    if params.HasField("logprobs"):
        if params.logprobs > MAX_TOP_LOGPROBS:
            raise _bad(f"sampling.logprobs must be at most {MAX_TOP_LOGPROBS}", "sampling.logprobs")
        options.logprobs = params.logprobs
    return options


def _generation_seconds(request: Any) -> float | None:
    if not request.HasField("max_generation_seconds"):
        return None
    value = request.max_generation_seconds
    if not math.isfinite(value) or value <= 0:
        raise _bad("max_generation_seconds must be a positive number", "max_generation_seconds")
    return value


def chat_from_proto(request: inference_pb2.ChatRequest) -> GenerationInput:
    if not request.model:
        raise GatewayError(ErrorKind.INVALID_REQUEST, "model is required: name one from ListModels", param="model")
    if not request.messages:
        raise GatewayError(ErrorKind.INVALID_REQUEST, "messages is required: at least one {role, content}",
                           param="messages")
    messages = [_message(i, {"role": m.role, "content": m.content}) for i, m in enumerate(request.messages)]
    return GenerationInput(
        route="chat",
        model=request.model,
        sampling=_sampling_from_proto(request.sampling),
        messages=messages,
        stream=True,
        max_generation_seconds=_generation_seconds(request),
    )


def generate_from_proto(request: inference_pb2.GenerateRequest) -> GenerationInput:
    if not request.model:
        raise GatewayError(ErrorKind.INVALID_REQUEST, "model is required: name one from ListModels", param="model")
    if bool(request.prompt) == bool(request.prompt_token_ids):
        raise GatewayError(ErrorKind.INVALID_REQUEST, "set exactly one of prompt and prompt_token_ids",
                           param="prompt")
    return GenerationInput(
        route="completion",
        model=request.model,
        sampling=_sampling_from_proto(request.sampling),
        prompt_text=request.prompt or None,
        prompt_ids=list(request.prompt_token_ids) or None,
        stream=True,
        max_generation_seconds=_generation_seconds(request),
    )
