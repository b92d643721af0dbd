"""A validated request becomes a `Job`: token ids, prefix hashes, the
max_tokens it may use, its class and its time budget. Transport-neutral.

A `Job` is built once per request (by the front door) and only read after
that. Its arrival is stamped on the gateway's injected clock: wall time for
the scheduler (aging, kept across re-admission), monotonic time for TTFT."""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass

from services.common.clock import Clock
from services.common.config import MeshConfig
from services.common.metric_labels import priority_label
from services.common.openai_api.requests import GenerationInput, SamplingOptions
from services.common.openai_api.structured_outputs import StructuredSpec
from services.common.proto.kvmesh.v1 import scheduler_pb2
from services.common.tool_calling.call_format import call_format, offered_tools
from services.common.tracing import NO_SPAN, Span
from services.gateway.errors import ErrorKind, GatewayError
from services.gateway.keys import Principal
from services.gateway.tokenization import ModelTokenizer

__all__ = ["Job", "build_job", "parse_last_event_id", "request_id_from"]

_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")


def request_id_from(header: str | None, attempt: str | None = None) -> str:
    """The client's x-request-id if it is a sane token, else a fresh one.
    Envoy's retry of a request (`x-envoy-attempt-count` > 1: the first
    attempt's gateway died or was cut off before answering) gets an id of its
    own: the first attempt may have been admitted, and its lease and
    generation are kept for a resume under the original id."""
    request_id = header if header and _REQUEST_ID.match(header) else uuid.uuid4().hex
    if attempt and attempt.isdigit() and int(attempt) > 1 and len(request_id) <= 120:
        request_id = f"{request_id}-try{int(attempt)}"
    return request_id


def parse_last_event_id(header: str | None) -> tuple[str, int] | None:
    """`Last-Event-ID: <request_id>.<n>` -> (request_id, n); None without
    the header; a malformed one is the client's error (400)."""
    if header is None:
        return None
    request_id, _, index = header.strip().rpartition(".")
    if not _REQUEST_ID.match(request_id) or not index.isdigit() or len(index) > 9:
        raise GatewayError(
            ErrorKind.INVALID_REQUEST,
            f"Last-Event-ID {header[:160]!r} is not an event id of this API: send the `id:` of the last "
            "event you received, <request_id>.<n>", param="Last-Event-ID", code="invalid_last_event_id")
    return request_id, int(index)


@dataclass
class Job:
    request_id: str
    route: str                      # "chat" | "completion": metric label and response shape
    model: str
    tenant: str
    priority: int                   # 0..2, already capped by the key's ceiling
    prompt_ids: list[int]
    prefix_hashes: list[int]
    sampling: SamplingOptions
    max_tokens: int
    max_generation_seconds: float
    arrival_unix: float
    arrival_monotonic: float
    hash_block_tokens: int
    # A client's resume (Last-Event-ID / ResumeFrom): the index of the last
    # event it has; None for a new request. README "Resuming a stream".
    resume_from: int | None = None
    # n > 1 (services/gateway/choices.py): how many choices, and for a copy
    # (choice 1..n-1) the request whose engine it joins.
    n: int = 1
    together_with: str = ""
    echo_text: str = ""   # completions `echo`: sent first in each choice
    # The output constraint the engine enforces (GenerationInput.structured).
    structured: StructuredSpec | None = None
    # Its `gateway.request` span (request_trace.py; NO_SPAN with tracing
    # off) and that span's W3C context, sent on to the scheduler and engines.
    trace: Span = NO_SPAN
    trace_context: tuple[tuple[str, str], ...] = ()
    # A Batch API line (services/gateway/batch_lines.py): P2 the scheduler
    # never ages nor lets take a P0-reserved slot, queued until the batch's
    # completion window ends (unix seconds).
    batch: bool = False
    batch_deadline_unix: float = 0.0

    @property
    def metric_labels(self) -> tuple[str, str, str]:
        """(route, priority, model_name): the labels of the gateway's
        per-request histograms (services/gateway/metrics.py)."""
        return (self.route, priority_label(self.priority), self.model)

    def admit_request(self) -> scheduler_pb2.AdmitRequest:
        request = scheduler_pb2.AdmitRequest(
            request_id=self.request_id,
            model=self.model,
            tenant=self.tenant,
            priority=self.priority,
            prompt_tokens=len(self.prompt_ids),
            max_tokens=self.max_tokens,
            prefix_hashes=self.prefix_hashes,
            arrival_unix=self.arrival_unix,
            resume=self.resume_from is not None,
            together_with=self.together_with,
            batch=self.batch,
            batch_deadline_unix=self.batch_deadline_unix,
        )
        if self.trace_context:
            request.trace_context.update(dict(self.trace_context))
        return request


async def build_job(
    request: GenerationInput,
    tokenizer: ModelTokenizer,
    principal: Principal,
    priority: int,
    request_id: str,
    config: MeshConfig,
    clock: Clock,
) -> Job:
    arrival_unix, arrival_monotonic = clock.wall(), clock.monotonic()
    block = config.hash_block_tokens
    if request.messages is not None:
        prompt = await tokenizer.tokenize_chat(request.messages, block, offered_tools(request),
                                               call_format(request, tokenizer.tool_parser))
    elif request.prompt_ids is not None:
        prompt = await tokenizer.from_ids(request.prompt_ids, block)
    else:
        prompt = await tokenizer.tokenize_text(request.prompt_text or "", block)
    if not prompt.token_ids:
        raise GatewayError(ErrorKind.INVALID_REQUEST, "the prompt is empty after tokenization", param="prompt")
    bad = next((t for t in request.sampling.logit_bias if t >= tokenizer.vocab_size), None)
    if bad is not None:
        raise GatewayError(ErrorKind.INVALID_REQUEST, f"logit_bias token id {bad} is outside the model's "
                           f"vocabulary (size {tokenizer.vocab_size})", param="logit_bias")
    return Job(
        request_id=request_id,
        route=request.route,
        model=request.model,
        tenant=principal.tenant,
        priority=priority,
        prompt_ids=prompt.token_ids,
        prefix_hashes=prompt.prefix_hashes,
        sampling=request.sampling,
        structured=request.structured,
        max_tokens=_max_tokens(request, len(prompt.token_ids), tokenizer.max_model_len, config),
        max_generation_seconds=_time_limit(request, principal, config),
        arrival_unix=arrival_unix,
        arrival_monotonic=arrival_monotonic,
        hash_block_tokens=block,
        n=request.n,
        echo_text=_echo_text(request, prompt.token_ids, tokenizer),
    )


def _echo_text(request: GenerationInput, prompt_ids: list[int], tokenizer: ModelTokenizer) -> str:
    """The prompt as `echo` shows it: the client's text, or its token ids decoded."""
    if not request.echo:
        return ""
    return request.prompt_text if request.prompt_text is not None else tokenizer.decode(prompt_ids)


def _max_tokens(request: GenerationInput, n_prompt: int, context: int, config: MeshConfig) -> int:
    """What the completion may use: the client's ask if it fits the model's
    context, else the default capped by what is left of the context."""
    asked = request.sampling.max_tokens
    param = "max_tokens" if request.route == "completion" else "max_completion_tokens"
    if asked is None:
        if n_prompt >= context:
            raise GatewayError(
                ErrorKind.INVALID_REQUEST,
                f"this model's maximum context length is {context} tokens, but the prompt has {n_prompt} tokens; "
                "shorten the prompt",
                param="messages" if request.route == "chat" else "prompt",
                code="context_length_exceeded",
            )
        return min(config.gateway.default_max_tokens, context - n_prompt)
    if n_prompt + asked > context:
        raise GatewayError(
            ErrorKind.INVALID_REQUEST,
            f"this model's maximum context length is {context} tokens, but you requested "
            f"{n_prompt + asked} tokens ({n_prompt} in the prompt, {asked} for the completion); "
            f"shorten the prompt or lower {param}",
            param=param,
            code="context_length_exceeded",
        )
    return asked


def _time_limit(request: GenerationInput, principal: Principal, config: MeshConfig) -> float:
    """The tightest of the gateway's, the key's and the request's limits."""
    limit = config.gateway.max_generation_seconds
    if principal.max_generation_seconds > 0:
        limit = min(limit, principal.max_generation_seconds)
    if request.max_generation_seconds is not None:
        limit = min(limit, request.max_generation_seconds)
    return limit
