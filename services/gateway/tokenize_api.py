"""`POST /tokenize` and `POST /detokenize` as vLLM's server offers them
(vllm/entrypoints/serve/tokenize/protocol.py), served with the gateway's own
tokenizer for the model -- the ids a request's prompt runs as -- and keyed
like the other endpoints (the key must allow the model). Also the gRPC
Tokenize / Detokenize. No engine is involved.

Tokenize: `{model, prompt, add_special_tokens=true, return_token_strs}` or
`{model, messages, add_generation_prompt=true, add_special_tokens=false,
return_token_strs}` -> `{count, max_model_len, tokens, token_strs}`.
Detokenize: `{model, tokens}` -> `{prompt}`. `model` may be left out when
the gateway serves one model, as with vLLM.
"""

from __future__ import annotations

from typing import Any

from services.common.openai_api.requests import invalid, parse_message
from services.gateway.errors import ErrorKind, GatewayError
from services.gateway.frontdoor import Frontdoor
from services.gateway.keys import Principal
from services.gateway.tokenization import ModelTokenizer

__all__ = ["TokenizeApi"]

_TOKEN_MAX = 2**63 - 1


def _flag(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise invalid(f"{name} must be true or false", name)
    return value


class TokenizeApi:
    def __init__(self, frontdoor: Frontdoor) -> None:
        self._frontdoor = frontdoor

    def _tokenizer(self, principal: Principal, body: Any) -> tuple[dict[str, Any], ModelTokenizer]:
        if not isinstance(body, dict):
            raise GatewayError(ErrorKind.INVALID_REQUEST, "the request body must be a JSON object")
        names = self._frontdoor.model_names
        model = body.get("model")
        if model is None and len(names) == 1:
            model = names[0]
        if not isinstance(model, str) or not model:
            raise GatewayError(ErrorKind.INVALID_REQUEST, "model is required: name one from GET /v1/models",
                               param="model", code="missing_required_parameter")
        return body, self._frontdoor.tokenizer_for(principal, model)

    def tokenize(self, principal: Principal, raw: Any) -> dict[str, Any]:
        body, tokenizer = self._tokenizer(principal, raw)
        if ("prompt" in body) == ("messages" in body):
            raise invalid("send exactly one of prompt and messages", "prompt")
        if "prompt" in body:
            prompt = body["prompt"]
            if not isinstance(prompt, str):
                raise invalid("prompt must be a string", "prompt")
            ids = tokenizer.encode(prompt, _flag(body, "add_special_tokens", True))
        else:
            messages = body["messages"]
            if not isinstance(messages, list) or not messages:
                raise invalid("messages must be a non-empty list of {role, content}", "messages")
            parsed = [parse_message(i, m) for i, m in enumerate(messages)]
            text = tokenizer.render_chat(parsed, _flag(body, "add_generation_prompt", True))
            ids = tokenizer.encode(text, _flag(body, "add_special_tokens", False))
        out: dict[str, Any] = {"count": len(ids), "max_model_len": tokenizer.max_model_len, "tokens": ids,
                               "token_strs": None}
        if _flag(body, "return_token_strs", False):
            out["token_strs"] = tokenizer.token_strs(ids)
        return out

    def detokenize(self, principal: Principal, raw: Any) -> dict[str, Any]:
        body, tokenizer = self._tokenizer(principal, raw)
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= _TOKEN_MAX for t in tokens
        ):
            raise invalid("tokens must be a list of token ids", "tokens")
        bad = next((t for t in tokens if t >= tokenizer.vocab_size), None)
        if bad is not None:
            raise invalid(f"token id {bad} is outside the model's vocabulary (size {tokenizer.vocab_size})",
                          "tokens")
        return {"prompt": tokenizer.decode(tokens)}
