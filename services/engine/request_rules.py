"""The rules every engine request must meet, whichever backend runs it
(`validate_request`; EngineRuntime.open calls it for every transport)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from services.engine.backend import BackendInfo, GenerationRequest, InvalidRequest, Sampling

__all__ = ["MAX_PRIORITY", "validate_request"]

MAX_PRIORITY = 2


@dataclass(frozen=True)
class _Range:
    """An optional sampling field's allowed values (None = engine default,
    always allowed). The bounds are vLLM's, the strictest backend's, so a
    request valid on one backend is valid on every one."""

    field: str
    low: float
    high: float = math.inf
    low_open: bool = False  # low itself is not allowed
    integer: bool = False

    def check(self, value: object) -> None:
        if value is None:
            return
        if isinstance(value, bool) or not isinstance(value, int if self.integer else (int, float)):
            kind = "an integer" if self.integer else "a number"
            raise InvalidRequest(f"sampling.{self.field} must be {kind}, got {value!r}")
        above = value > self.low if self.low_open else value >= self.low
        if not (above and value <= self.high and math.isfinite(value)):
            left = "(" if self.low_open else "["
            right = "]" if math.isfinite(self.high) else ")"
            raise InvalidRequest(
                f"sampling.{self.field} must be in {left}{self.low:g}, {self.high:g}{right}, got {value!r}"
            )


# Literal table: one row per optional sampling field with a range.
_SAMPLING_RANGES = (
    _Range("temperature", 0.0, 2.0),
    _Range("top_p", 0.0, 1.0, low_open=True),
    _Range("top_k", -1, integer=True),  # -1 and 0 both mean "no top-k" (vLLM's convention)
    _Range("min_p", 0.0, 1.0),
    _Range("presence_penalty", -2.0, 2.0),
    _Range("frequency_penalty", -2.0, 2.0),
    _Range("repetition_penalty", 0.0, low_open=True),
    _Range("logprobs", 0, integer=True),
)


def validate_request(request: GenerationRequest, info: BackendInfo) -> None:
    """The rules every backend shares, checked here once for every transport;
    raises InvalidRequest (INVALID_ARGUMENT) saying what to change. A backend
    checks only what is its own (the sim: KV capacity; vLLM: its sampling
    and input checks). A live duplicate id is `EngineRuntime.open`'s rule."""
    if not request.request_id:
        raise InvalidRequest("request_id is empty: give every request a unique id")
    prompt = request.prompt_token_ids
    if not prompt:
        raise InvalidRequest("prompt_token_ids is empty: send at least one token")
    if request.sampling.max_tokens <= 0:
        raise InvalidRequest("sampling.max_tokens must be at least 1")
    if not 0 <= request.priority <= MAX_PRIORITY:
        raise InvalidRequest(f"priority {request.priority} is out of range: use 0 (P0) .. 2 (P2)")
    if request.resumed_tokens > len(prompt):
        raise InvalidRequest(
            f"resumed_tokens ({request.resumed_tokens}) exceeds the {len(prompt)} tokens sent"
        )
    total = len(prompt) + request.sampling.max_tokens
    if info.max_model_len and total > info.max_model_len:
        raise InvalidRequest(
            f"prompt ({len(prompt)} tokens) + max_tokens ({request.sampling.max_tokens}) = {total} "
            f"exceeds max_model_len {info.max_model_len}; shorten the prompt or lower max_tokens"
        )
    if info.vocab_size:
        bad = next((t for t in prompt if not 0 <= t < info.vocab_size), None)
        if bad is not None:
            raise InvalidRequest(f"token id {bad} is out of the vocabulary (size {info.vocab_size})")
        bad = next((t for t in request.sampling.logit_bias if t >= info.vocab_size), None)
        if bad is not None:
            raise InvalidRequest(f"logit_bias token id {bad} is out of the vocabulary (size {info.vocab_size})")
    _validate_sampling(request.sampling)


def _validate_sampling(sampling: Sampling) -> None:
    for rule in _SAMPLING_RANGES:
        rule.check(getattr(sampling, rule.field))
    if len(sampling.logit_bias) > 300 or any(not -100 <= b <= 100 for b in sampling.logit_bias.values()):
        raise InvalidRequest("sampling.logit_bias takes at most 300 entries, each bias in [-100, 100]")
    if not 0 <= sampling.min_tokens <= sampling.max_tokens:
        raise InvalidRequest(
            f"sampling.min_tokens must be in [0, max_tokens={sampling.max_tokens}], got {sampling.min_tokens}"
        )
