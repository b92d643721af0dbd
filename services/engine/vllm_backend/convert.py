"""One request's traffic between kvmesh's types and vLLM's.

In: kvmesh `Sampling` -> vLLM SamplingParams (`sampling_params`; vLLM's own
validation of them is the adapter's one sampling check, an InvalidRequest).
A structured output goes to vLLM's own StructuredOutputsParams (xgrammar,
`structured_fields`) on a fresh request; on a resumed one (a migration: the
prompt ends with tokens generated elsewhere) it goes in `extra_args` to
kvmesh's logits processor (resume_grammar.py), which advances the grammar
over those tokens first.
Out: vLLM's DELTA RequestOutputs -> `GenerationOutput`s (`RequestUsage`,
which also keeps the request's usage counters), its logprobs -> kvmesh's
TokenLogprob dicts, and the text vLLM holds back for a stop string
(`held_text`). Pure conversions: no state beyond one request's counters.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from services.common.finish_reason import FinishReason
from services.common.openai_api.structured_outputs import StructuredSpec
from services.engine.backend import GenerationOutput, InvalidRequest, Sampling
from services.engine.vllm_backend.vllm_api import VllmApi

__all__ = ["RESUMED_STRUCTURED", "RequestUsage", "held_text", "sampling_kwargs", "sampling_params",
           "structured_fields"]

# SamplingParams.extra_args key of a resumed structured request:
# {"kind", "value", "resumed_tokens"} (read by resume_grammar.py).
RESUMED_STRUCTURED = "kvmesh_resumed_structured"


def structured_fields(spec: StructuredSpec) -> dict[str, Any]:
    """kvmesh StructuredSpec -> vLLM StructuredOutputsParams keyword arguments."""
    if spec.kind == "json_schema":
        return {"json": spec.value}
    if spec.kind == "json_object":
        return {"json_object": True}
    if spec.kind == "choice":
        return {"choice": list(json.loads(spec.value))}
    return {spec.kind: spec.value}  # regex, grammar


def sampling_kwargs(sampling: Sampling, resumed_tokens: int = 0) -> dict[str, Any]:
    """kvmesh Sampling -> vLLM SamplingParams keyword arguments. None means
    "engine default", so it is left out and vLLM's default applies. A
    structured output is left to `sampling_params` (it needs vLLM's type)."""
    kwargs: dict[str, Any] = {
        "max_tokens": sampling.max_tokens,
        "min_tokens": sampling.min_tokens,
        "ignore_eos": sampling.ignore_eos,
    }
    optional = {
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k,
        "min_p": sampling.min_p,
        "seed": sampling.seed,
        "presence_penalty": sampling.presence_penalty,
        "frequency_penalty": sampling.frequency_penalty,
        "repetition_penalty": sampling.repetition_penalty,
        "logprobs": sampling.logprobs,
    }
    kwargs.update({k: v for k, v in optional.items() if v is not None})
    if sampling.stop:
        kwargs["stop"] = list(sampling.stop)
    if sampling.stop_token_ids:
        kwargs["stop_token_ids"] = list(sampling.stop_token_ids)
    if sampling.logit_bias:
        kwargs["logit_bias"] = dict(sampling.logit_bias)
    spec = sampling.structured
    if spec is not None and resumed_tokens:
        kwargs["extra_args"] = {RESUMED_STRUCTURED: {"kind": spec.kind, "value": spec.value,
                                                     "resumed_tokens": resumed_tokens}}
    return kwargs


def sampling_params(api: VllmApi, sampling: Sampling, resumed_tokens: int = 0) -> Any:
    """vLLM's SamplingParams (DELTA outputs); InvalidRequest if vLLM refuses them
    (its constraint checks run when the request is added: also InvalidRequest)."""
    kwargs = sampling_kwargs(sampling, resumed_tokens)
    try:
        if sampling.structured is not None and not resumed_tokens:
            kwargs["structured_outputs"] = api.structured_outputs(**structured_fields(sampling.structured))
        return api.sampling_params(**kwargs, output_kind=api.delta)
    except (ValueError, TypeError, api.client_error) as exc:
        raise InvalidRequest(f"invalid sampling parameters: {exc}") from exc


@dataclass
class RequestUsage:
    """Per-request counters while converting vLLM's DELTA outputs."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    outputs: int = 0

    def convert(self, out: Any) -> GenerationOutput:
        """One vLLM RequestOutput -> GenerationOutput. vLLM's own finish
        reasons outside kvmesh's set (e.g. "repetition") are errors."""
        self.outputs += 1
        if out.num_cached_tokens is not None:
            self.cached_tokens = int(out.num_cached_tokens)
        completion = out.outputs[0] if out.outputs else None
        token_ids = list(completion.token_ids) if completion is not None else []
        self.completion_tokens += len(token_ids)
        reason = None
        if out.finished:
            reason = FinishReason.parse(completion.finish_reason if completion is not None else None)
        return GenerationOutput(
            token_ids=token_ids,
            text=completion.text if completion is not None else "",
            logprobs=_logprobs(completion, token_ids),
            finish_reason=reason,
            prompt_tokens=self.prompt_tokens,
            cached_tokens=self.cached_tokens,
            completion_tokens=self.completion_tokens,
        )

    def finish(self, reason: FinishReason, message: str) -> GenerationOutput:
        """A final output of our own (vLLM gave none: abort or failure)."""
        return GenerationOutput(
            token_ids=[],
            text="",
            finish_reason=reason,
            prompt_tokens=self.prompt_tokens,
            cached_tokens=self.cached_tokens,
            completion_tokens=self.completion_tokens,
            message=message,
        )


def _logprobs(completion: Any, token_ids: list[int]) -> list[dict] | None:
    """vLLM's per-token {token_id: Logprob} -> kvmesh TokenLogprob dicts
    (token_id, token, logprob, top: [{token_id, token, logprob}], by rank)."""
    if completion is None or completion.logprobs is None:
        return None
    result: list[dict] = []
    for token_id, entries in zip(token_ids, completion.logprobs):
        chosen = entries.get(token_id)
        top = sorted(
            (
                (lp.rank if lp.rank is not None else 1 << 30, tid, lp)
                for tid, lp in entries.items()
            ),
            key=lambda item: (item[0], item[1]),
        )
        result.append(
            {
                "token_id": token_id,
                "token": (chosen.decoded_token or "") if chosen else "",
                "logprob": float(chosen.logprob) if chosen else float("-inf"),
                "top": [
                    {"token_id": tid, "token": lp.decoded_token or "", "logprob": float(lp.logprob)}
                    for _, tid, lp in top
                ],
            }
        )
    return result


def held_text(llm: Any, request_id: str) -> str:
    """The text vLLM holds back for a possible stop string, right after
    the output just read (read in the same step of the event loop as
    that output, so it covers exactly the tokens delivered so far).
    vLLM has no API for it: this reads its output processor's
    detokenizer (vLLM 0.32); if that changes, "" (nothing recoverable at
    a migration, as before)."""
    try:
        processor = llm.output_processor
        for internal_id in processor.external_req_ids.get(request_id, ()):
            detokenizer = processor.request_states[internal_id].detokenizer
            return str(detokenizer.output_text[detokenizer._last_output_text_offset:])  # noqa: SLF001 - vLLM keeps it private; guarded below
    except (AttributeError, KeyError, TypeError):
        return ""
    return ""
