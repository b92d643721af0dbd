"""Structured outputs across a migration: vLLM's grammar, continued.

After a migration the new engine gets prompt + the tokens already generated
(`GenerationRequest.resumed_tokens` of them at the end of the prompt). vLLM's
own structured-output path would start its grammar fresh at the first NEW
token — the constraint would restart in the middle of a JSON object. So a
resumed structured request skips vLLM's path (convert.py puts the constraint
in `SamplingParams.extra_args` instead) and this logits processor enforces
it: it compiles the same grammar with vLLM's own xgrammar backend (same
compiler options, same stop tokens, so any prefix vLLM's path produced is
accepted here), advances a GrammarMatcher over the resumed tokens, then over
each new token, and masks every step's logits with the matcher's bitmask.
Fresh requests never reach it (vLLM's native path, asynchronous grammar
compilation and all); with none resumed it costs one dict check per step.

Loaded by vLLM by name (engine arg `logits_processors`, launch.py) in its
engine core; `validate_params` also runs in the front end when a request is
added, so a constraint xgrammar refuses is the request's InvalidRequest
(400) before any token. Nothing here may raise inside a model step (that
would kill the engine core for every request): a failure is logged and the
request continues unconstrained.

Imports vLLM, torch and xgrammar at load time: only vLLM imports this module.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import xgrammar as xgr
from vllm.sampling_params import SamplingParams, StructuredOutputsParams
from vllm.tokenizers import cached_tokenizer_from_config
from vllm.v1.sample.logits_processor import AdapterLogitsProcessor
from vllm.v1.structured_output.backend_xgrammar import XgrammarBackend, validate_xgrammar_grammar
from vllm.v1.structured_output.request import get_structured_output_key

from services.common.openai_api.structured_outputs import STRUCTURED_KINDS, StructuredSpec
from services.engine.vllm_backend.convert import RESUMED_STRUCTURED, structured_fields

__all__ = ["ResumedGrammarProcessor"]

log = logging.getLogger("kvmesh.engine.vllm.resume_grammar")


def _spec(params: SamplingParams) -> tuple[StructuredSpec, int] | None:
    """The resumed constraint a request carries, and how many prompt tokens
    were generated elsewhere; None for every other request."""
    extra = params.extra_args or {}
    raw = extra.get(RESUMED_STRUCTURED)
    if not isinstance(raw, dict):
        return None
    kind, value, resumed = raw.get("kind"), raw.get("value", ""), raw.get("resumed_tokens", 0)
    if kind not in STRUCTURED_KINDS or not isinstance(value, str) or not isinstance(resumed, int) or resumed < 0:
        raise ValueError(f"malformed {RESUMED_STRUCTURED}: {raw!r:.200}")
    return StructuredSpec(kind=kind, value=value), resumed


def _vllm_params(spec: StructuredSpec) -> StructuredOutputsParams:
    """vLLM's checked, normalised constraint (choice becomes a grammar),
    exactly as its own path prepares it."""
    so = StructuredOutputsParams(**structured_fields(spec))
    validate_xgrammar_grammar(SamplingParams(structured_outputs=so))  # raises VLLMValidationError
    return so


class _ResumedRequest:
    """One request's matcher: advanced over the resumed tokens on first use,
    then over each new output token; masks the row's logits."""

    def __init__(self, grammar: Any, resumed: int, vocab_size: int, request: str) -> None:
        self._grammar = grammar          # vLLM's XgrammarGrammar (accept_tokens, fill_bitmask, is_terminated)
        self._resumed = resumed
        self._seen = -1                  # output tokens accepted; -1 = resumed prefix not yet
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)
        self._vocab_size = vocab_size
        self._request = request
        self._failed = False

    def __call__(self, prompt_ids: list[int], output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        if self._failed:
            return logits
        try:
            if self._seen < 0:
                self._accept(prompt_ids[len(prompt_ids) - self._resumed:] if self._resumed else [])
                self._seen = 0
            if len(output_ids) > self._seen:
                self._accept(output_ids[self._seen:])
                self._seen = len(output_ids)
            if self._failed or self._grammar.is_terminated():
                return logits
            self._grammar.fill_bitmask(self._bitmask, 0)
            row = logits.unsqueeze(0)
            xgr.apply_token_bitmask_inplace(row, self._bitmask.to(logits.device), vocab_size=self._vocab_size)
            return logits
        except Exception:  # never raise in a model step: the engine core would die for everyone
            log.exception("resumed grammar failed for %s; continuing unconstrained", self._request)
            self._failed = True
            return logits

    def _accept(self, tokens: list[int]) -> None:
        if tokens and not self._grammar.accept_tokens(self._request, list(tokens)):
            log.error("resumed grammar rejected the tokens of %s; continuing unconstrained", self._request)
            self._failed = True


class ResumedGrammarProcessor(AdapterLogitsProcessor):
    """vLLM V1 logits processor: the grammar of resumed structured requests."""

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        super().__init__(vllm_config, device, is_pin_memory)
        self._config = vllm_config
        self._backend: XgrammarBackend | None = None
        try:  # now, at engine start: xgrammar's vocabulary view takes seconds, not for a request's step
            self._xgrammar()
        except Exception:  # e.g. no tokenizer (skip_tokenizer_init): retried, and logged, on first use
            log.warning("resumed-grammar backend not built at start; will try on the first resumed request",
                        exc_info=True)

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        found = _spec(sampling_params)
        if found is not None:
            _vllm_params(found[0])

    def is_argmax_invariant(self) -> bool:
        return False  # a mask changes greedy picks

    def new_req_logits_processor(self, params: SamplingParams) -> Any:
        try:
            found = _spec(params)
            if found is None:
                return None
            spec, resumed = found
            backend = self._xgrammar()
            kind, text = get_structured_output_key(_vllm_params(spec))
            grammar = backend.compile_grammar(kind, text, stop_token_ids=params.all_stop_token_ids)
            return _ResumedRequest(grammar, resumed, backend.vocab_size, f"resumed-{id(params):x}")
        except Exception:  # validated at admission; this is a bug, not the client's: never kill the core
            log.exception("could not build the resumed grammar; the request runs unconstrained")
            return None

    def _xgrammar(self) -> XgrammarBackend:
        if self._backend is None:
            model = self._config.model_config
            self._backend = XgrammarBackend(self._config, tokenizer=cached_tokenizer_from_config(model_config=model),
                                            vocab_size=model.get_vocab_size())
        return self._backend
