"""The request fields that shape a response's choices rather than one
sampling step: `n` (how many choices), `echo` (completions: the prompt
first) and `logit_bias` (token id -> bias). Pure parsing, no I/O; 400s name
the parameter.

Bounds: n <= MAX_N (each choice is a generation of its own on the engine,
sharing the prompt's KV -- README "n > 1"); logit_bias as OpenAI bounds it
(at most 300 entries, each bias in [-100, 100]).
"""

from __future__ import annotations

from typing import Any

from services.common.openai_api.errors import ApiError, ErrorKind

__all__ = ["MAX_LOGIT_BIAS", "MAX_N", "parse_echo", "parse_logit_bias", "parse_n"]

# A request's choices run as that many generations on one engine: 8 keeps one
# request from taking a batch's worth of slots (vLLM's default max_num_seqs is 256,
# kvmesh's default engine batch 16-64).
MAX_N = 8
MAX_LOGIT_BIAS = 300   # OpenAI's limit
_TOKEN_ID_MAX = 2**32 - 1


def _invalid(message: str, param: str) -> ApiError:
    return ApiError(ErrorKind.INVALID_REQUEST, message, param=param, code="invalid_value")


def parse_n(body: dict[str, Any]) -> int:
    value = body.get("n")
    if value is None:
        return 1
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_N:
        raise _invalid(f"n must be an integer between 1 and {MAX_N}, got {value!r:.80}", "n")
    return value


def parse_echo(body: dict[str, Any]) -> bool:
    value = body.get("echo")
    if value is None:
        return False
    if not isinstance(value, bool):
        raise _invalid(f"echo must be true or false, got {value!r:.80}", "echo")
    return value


def parse_logit_bias(body: dict[str, Any]) -> dict[int, float]:
    """{"<token id>": bias} (JSON object keys are strings) -> {id: bias}."""
    value = body.get("logit_bias")
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise _invalid("logit_bias must be an object mapping token ids to a bias in [-100, 100]", "logit_bias")
    if len(value) > MAX_LOGIT_BIAS:
        raise _invalid(f"logit_bias may hold at most {MAX_LOGIT_BIAS} entries, got {len(value)}", "logit_bias")
    out: dict[int, float] = {}
    for key, bias in value.items():
        token = str(key)
        if not token.isascii() or not token.isdigit() or len(token) > 10 or int(token) > _TOKEN_ID_MAX:
            raise _invalid(f"logit_bias keys must be token ids (non-negative integers), got {token!r:.40}",
                           "logit_bias")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
            raise _invalid(f"logit_bias[{token}] must be a number in [-100, 100], got {bias!r:.40}", "logit_bias")
        out[int(token)] = float(bias)
    return out
