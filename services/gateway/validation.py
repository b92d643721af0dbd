"""Turn what a client sent over gRPC (Inference protos) and the X-Priority
header into a validated `GenerationInput`, or a 400 naming the parameter.

The OpenAI JSON bodies are parsed by services/common/openai_api/requests.py
(shared with the engine's HTTP endpoint); the protos go through the same
checks (`sampling_from_body`, `parse_message`), so HTTP and gRPC take the same
values. Pure functions, no I/O.
"""

from __future__ import annotations

import math
from typing import Any

from services.common.openai_api.choices import parse_n
from services.common.openai_api.requests import (
    MAX_TOP_LOGPROBS,
    GenerationInput,
    SamplingOptions,
    invalid,
    parse_message,
    sampling_from_body,
    show_value,
)
from services.common.openai_api.structured_outputs import StructuredSpec, check_structured, structured_from_proto
from services.common.proto.kvmesh.v1 import common_pb2, inference_pb2
from services.common.tool_calling.grpc_mapping import message_from_proto, tool_request_from_proto
from services.common.tool_calling.request import set_tool_request
from services.gateway.errors import ErrorKind, GatewayError

__all__ = [
    "chat_from_proto",
    "generate_from_proto",
    "parse_priority_header",
    "priority_from_proto",
    "priority_to_proto",
]


def parse_priority_header(value: str | None) -> int:
    """`X-Priority: 0|1|2` (also P0/P1/P2); absent = P1."""
    if value is None or value.strip() == "":
        return 1
    raw = value.strip().upper().removeprefix("P")
    if raw not in ("0", "1", "2"):
        raise GatewayError(ErrorKind.INVALID_REQUEST, f"X-Priority must be 0, 1 or 2, got {show_value(value)}",
                           param="X-Priority", code="invalid_value")
    return int(raw)


# ------------------------------------------------------------ gRPC messages

_PRIORITY: dict[int, int] = {
    inference_pb2.PRIORITY_UNSPECIFIED: 1,
    inference_pb2.PRIORITY_P0: 0,
    inference_pb2.PRIORITY_P1: 1,
    inference_pb2.PRIORITY_P2: 2,
}


def priority_from_proto(value: int) -> int:
    if value not in _PRIORITY:
        raise invalid(f"priority must be PRIORITY_P0, PRIORITY_P1 or PRIORITY_P2, got {value}", "priority")
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
    if params.logit_bias:
        body["logit_bias"] = {str(k): v for k, v in params.logit_bias.items()}
    options = sampling_from_body(body)
    options.max_tokens = params.max_tokens or None
    options.min_tokens = params.min_tokens
    options.stop_token_ids = list(params.stop_token_ids)
    options.ignore_eos = params.ignore_eos
    if params.HasField("logprobs"):
        if params.logprobs > MAX_TOP_LOGPROBS:
            raise invalid(f"sampling.logprobs must be at most {MAX_TOP_LOGPROBS}", "sampling.logprobs")
        options.logprobs = params.logprobs
    return options


def _structured(params: common_pb2.SamplingParams) -> StructuredSpec | None:
    """sampling.structured, checked as HTTP checks response_format."""
    spec = structured_from_proto(params)
    if spec is None:
        if params.HasField("structured") and (params.structured.kind or params.structured.value):
            raise invalid("sampling.structured.kind must be one of KIND_JSON_SCHEMA, KIND_JSON_OBJECT, "
                          "KIND_REGEX, KIND_CHOICE, KIND_GRAMMAR", "sampling.structured.kind")
        return None
    return check_structured(spec, "sampling.structured.value")


def _generation_seconds(request: Any) -> float | None:
    if not request.HasField("max_generation_seconds"):
        return None
    value = request.max_generation_seconds
    if not math.isfinite(value) or value <= 0:
        raise invalid("max_generation_seconds must be a positive number", "max_generation_seconds")
    return value


def _n(request: Any) -> int:
    """`n` (0 = 1), the HTTP bound; no resume with n > 1."""
    n = parse_n({"n": request.n or 1})
    if n > 1 and request.HasField("resume"):
        raise invalid("a stream with n > 1 cannot be resumed; send the request again", "resume")
    return n


def chat_from_proto(request: inference_pb2.ChatRequest) -> GenerationInput:
    if not request.model:
        raise GatewayError(ErrorKind.INVALID_REQUEST, "model is required: name one from ListModels", param="model")
    if not request.messages:
        raise GatewayError(ErrorKind.INVALID_REQUEST, "messages is required: at least one {role, content}",
                           param="messages")
    messages = [parse_message(i, message_from_proto(m)) for i, m in enumerate(request.messages)]
    generation = GenerationInput(
        route="chat",
        model=request.model,
        sampling=_sampling_from_proto(request.sampling),
        messages=messages,
        stream=True,
        max_generation_seconds=_generation_seconds(request),
        n=_n(request),
        structured=_structured(request.sampling),
    )
    set_tool_request(generation, tool_request_from_proto(request))  # services/common/tool_calling/grpc_mapping.py
    return generation


def generate_from_proto(request: inference_pb2.GenerateRequest) -> GenerationInput:
    if not request.model:
        raise GatewayError(ErrorKind.INVALID_REQUEST, "model is required: name one from ListModels", param="model")
    if bool(request.prompt) == bool(request.prompt_token_ids):
        raise GatewayError(ErrorKind.INVALID_REQUEST, "set exactly one of prompt and prompt_token_ids",
                           param="prompt")
    sampling = _sampling_from_proto(request.sampling)
    if request.echo and sampling.logprobs is not None:
        raise invalid("echo with logprobs is not supported: the prompt's logprobs are not computed", "echo")
    return GenerationInput(
        route="completion",
        model=request.model,
        sampling=sampling,
        prompt_text=request.prompt or None,
        prompt_ids=list(request.prompt_token_ids) or None,
        stream=True,
        max_generation_seconds=_generation_seconds(request),
        n=_n(request),
        echo=request.echo,
        structured=_structured(request.sampling),
    )
